"""Drafter training under torchrun: 2 CPU ranks (gloo on loopback) against one process on the same global batches.

Three torchrun launches in all: make-data workers + DDP training in one (`train-drafter --generate`), then a
run stopped half-way and resumed. Each runs in a network namespace of its own whose only interface is loopback
(where this machine lets the test make one).
"""
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from castspec.cli import main
from castspec.serving.live import free_port
from conftest import llama_config, make_hf, tiny_tokenizer

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
DATA_ARGS = ["--dtype", "fp32", "--max-prompts", "12", "--batch-size", "2", "--max-new-tokens", "24"]
TRAIN_ARGS = ["--steps", "6", "--seqs-per-step", "5", "--anchors", "6", "--block-size", "6", "--layers", "2",
              "--lr", "0.2", "--mask-token-id", "31", "--taps", "0,2", "--checkpoint-every", "2",
              "--export-every", "6", "--eval-per-domain", "0"]
# a new user + network namespace (root inside maps back to the caller) with its loopback interface up
NETNS = ["unshare", "--map-root-user", "--net", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"]


@functools.cache
def netns_works() -> bool:
    if not (shutil.which("unshare") and shutil.which("ip")):
        return False
    return subprocess.run(NETNS + ["true"], capture_output=True, timeout=30).returncode == 0


def loopback_only(cmd: list[str]) -> list[str]:
    """`cmd` in a network namespace whose only interface is loopback. --master-addr 127.0.0.1 is where the ranks
    look for torchrun's rendezvous store, not where it listens: torch's TCPStore binds the wildcard address, which
    in such a namespace is loopback alone. Without user namespaces here, `cmd` as it is, and a warning."""
    if netns_works():
        return NETNS + cmd
    warnings.warn("no network namespace could be made (unshare --map-root-user --net): torchrun's rendezvous store "
                  "listens on every interface of this machine during the test")
    return cmd


def torchrun(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    # gloo's sockets on loopback; the launcher's rendezvous store at 127.0.0.1
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    cmd = [TORCHRUN, "--nnodes", "1", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(free_port()), "-m", "castspec", "-v"] + args
    out = subprocess.run(loopback_only(cmd), capture_output=True, text=True, timeout=timeout, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def params(run: Path) -> dict:
    return torch.load(run / "checkpoint.pt", weights_only=False)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ddp") / "target"
    make_hf(llama_config(vocab=32, num_hidden_layers=4), seed=3).save_pretrained(d)
    tiny_tokenizer(32).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def ddp_run(target_dir):
    """torchrun: both ranks generate their share of the dataset, then train on all of it with DDP."""
    root = target_dir.parent
    out = torchrun(["train-drafter", "--generate", "--data", str(root / "data2"), "--out", str(root / "run2"),
                    "--target", str(target_dir)] + DATA_ARGS + TRAIN_ARGS)
    return root, out


def shards(data: Path) -> dict:
    return {f.name: torch.load(f, weights_only=True) for f in sorted((data / "shards").glob("*.pt"))}


def test_make_data_workers_write_the_single_process_dataset(ddp_run, target_dir):
    root, _ = ddp_run
    # a fresh process, as each rank is: training_prompts() lists the attributes of stdlib modules, which depend on
    # what the process has imported (a pytest process has imported far more)
    cmd = [sys.executable, "-m", "castspec", "make-data", "--out", str(root / "data1"), "--target", str(target_dir)]
    subprocess.run(cmd + DATA_ARGS, check=True, capture_output=True, timeout=240)
    one, two = shards(root / "data1"), shards(root / "data2")
    assert len(one) == 6 and one == two


def test_ddp_equals_one_process_on_the_same_global_batches(ddp_run, target_dir, capsys):
    root, out = ddp_run
    # every rank computed its share, and the shares add up to the global batches
    shares = {int(r): (int(a), int(b)) for r, a, b in
              re.findall(r"rank (\d) of 2 computed (\d+) of the (\d+) sequences", out.stderr)}
    assert set(shares) == {0, 1} and all(a > 0 for a, _ in shares.values())
    assert shares[0][0] + shares[1][0] == shares[0][1] == shares[1][1] > 6
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["ranks"] == 2 and report["steps"] == 6
    capsys.readouterr()
    args = ["train-drafter", "--data", str(root / "data1"), "--target", str(target_dir)] + DATA_ARGS + TRAIN_ARGS
    assert main(args + ["--out", str(root / "run1")]) == 0
    assert main(args + ["--out", str(root / "step1"), "--stop-after", "1"]) == 0
    ddp, single, start = params(root / "run2"), params(root / "run1"), params(root / "step1")
    assert ddp["world_size"] == 2 and single["world_size"] == 1
    moved = 0.0
    for k in single["drafter"]:
        torch.testing.assert_close(ddp["drafter"][k], single["drafter"][k], rtol=1e-4, atol=1e-5)
        moved = max(moved, (single["drafter"][k] - start["drafter"][k]).abs().max().item())
    assert moved > 1e-2  # five more steps moved the weights far beyond the tolerance above
    for key in ("step", "cursor", "epoch"):
        assert ddp["state"][key] == single["state"][key]


def test_ddp_stop_and_resume_equals_uninterrupted(ddp_run, target_dir):
    root, _ = ddp_run
    args = ["train-drafter", "--data", str(root / "data2"), "--out", str(root / "split"),
            "--target", str(target_dir)] + DATA_ARGS + TRAIN_ARGS
    torchrun(args + ["--stop-after", "3"])
    assert params(root / "split")["state"]["step"] == 3
    torchrun(args)
    full, split = params(root / "run2"), params(root / "split")
    assert split["state"]["step"] == 6
    for k in full["drafter"]:
        torch.testing.assert_close(split["drafter"][k], full["drafter"][k], rtol=0, atol=0)


def test_part_and_torchrun_conflict_and_bad_part(tmp_path, capsys, monkeypatch):
    assert main(["make-data", "--out", str(tmp_path), "--part", "2/2"]) == 2
    assert "--part must look like" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["make-data", "--out", str(tmp_path), "--part", "0/2"]) == 2
    assert "leave --part out under torchrun" in capsys.readouterr().err


def test_several_datasets_train_as_one(ddp_run, target_dir, capsys):
    # 30 sequences (6 steps x 5) from 12 records are 2.5 epochs; from the same dataset given twice, 1.25
    root, _ = ddp_run
    data = str(root / "data2")
    args = ["train-drafter", "--target", str(target_dir)] + DATA_ARGS + TRAIN_ARGS
    capsys.readouterr()
    assert main(args + ["--data", f"{data},{data}", "--out", str(root / "twice")]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["epoch"] == 1
    assert main(args + ["--data", f"{data},{root / 'none'}", "--out", str(root / "bad")]) == 2
    assert f"no training data in {root / 'none'}" in capsys.readouterr().err
