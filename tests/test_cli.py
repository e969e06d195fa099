"""The command line: happy path and the bad-input cases (non-zero exit, one line, no traceback)."""
import json
import subprocess
import sys

import pytest

from castspec.cli import main
from castspec.models.load import save_drafter
from conftest import llama_config, make_hf, native, random_drafter


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    hf = make_hf(llama_config(vocab=40))
    hf.save_pretrained(root / "target")
    target = native(hf)
    save_drafter(random_drafter(target), root / "drafter")
    other = native(make_hf(llama_config(vocab=40, hidden_size=32, num_attention_heads=2, num_key_value_heads=1)))
    save_drafter(random_drafter(other), root / "foreign")
    (root / "corrupt").mkdir()
    (root / "corrupt" / "config.json").write_text("{")
    return root


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_json(dirs, capsys):
    code, out, err = run_cli(capsys, "generate", "--target", str(dirs / "target"), "--drafter", str(dirs / "drafter"),
                             "--input-ids", "1,2,3", "--max-new-tokens", "6", "--json", "--dtype", "fp32")
    assert code == 0, err
    result = json.loads(out)
    assert len(result["token_ids"]) == 6 and result["stats"]["rounds"] >= 1
    code, out2, _ = run_cli(capsys, "generate", "--target", str(dirs / "target"), "--input-ids", "1 2 3",
                            "--max-new-tokens", "6", "--json", "--method", "ar", "--dtype", "fp32")
    assert code == 0 and json.loads(out2)["token_ids"] == result["token_ids"]


@pytest.mark.parametrize("args,message", [
    (["--max-new-tokens", "-1"], "max_new_tokens must be a non-negative integer"),
    (["--width", "-3"], "width must be a non-negative integer"),
    (["--width", "wide"], "--width must be an integer or 'auto'"),
    (["--method", "beam"], "unknown method 'beam'"),
    (["--temperature", "-0.5"], "temperature must be >= 0"),
    (["--drafter", "{root}/foreign"], "does not fit this target: hidden size 32 != target 64"),
    (["--drafter", "{root}/corrupt"], "invalid JSON"),
    (["--drafter", "{root}/missing"], "is not a directory"),
    (["--target", "{root}/missing"], "neither a directory"),
    (["--input-ids", "1,x"], "--input-ids must be integers"),
    (["--input-ids", "1,4000"], "outside the vocabulary"),
    (["--prompt", "hi"], "give exactly one of"),
    (["--method", "cast", "--drafter", ""], "the drafter path is empty"),
    (["--max-new-tokens", "600"], "exceeds the model's context of 512"),
])
def test_bad_input_is_one_line_without_traceback(dirs, capsys, args, message):
    base = {"--target": str(dirs / "target"), "--input-ids": "1,2,3", "--method": "ar"}
    args = [a.format(root=dirs) for a in args]
    for flag in list(base):
        if flag in args:
            del base[flag]
    argv = ["generate", *[x for kv in base.items() for x in kv], *args]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_help_for_every_subcommand():
    out = subprocess.run([sys.executable, "-m", "castspec", "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "generate" in out.stdout
    commands = ["generate", "demo", "bench", "probe", "make-data", "train-drafter", "eval-drafter", "serve",
                "loadtest"]
    assert all(c in out.stdout for c in commands)
    for cmd in commands:
        sub = subprocess.run([sys.executable, "-m", "castspec", cmd, "--help"], capture_output=True, text=True)
        assert sub.returncode == 0 and "usage:" in sub.stdout


@pytest.mark.parametrize("argv,message", [
    (["serve", "--policy", "widest"], "unknown policy 'widest'"),
    (["serve", "--method", "beam"], "unknown method 'beam'"),
    (["serve", "--port", "70000"], "--port must be in 1..65535"),
    (["serve", "--max-batch", "0"], "max_batch"),
    (["serve", "--target", "{root}/target", "--dtype", "fp32"], "needs a drafter"),
    (["loadtest", "--policies", "fixed"], "needs a width"),
    (["loadtest", "--concurrency", "1,x"], "--concurrency is a comma list"),
    (["loadtest", "--concurrency", "0"], "must be >= 1"),
    (["loadtest", "--prefix-cache-mb", "-1"], "--prefix-cache-mb must be >= 0"),
    (["serve", "--prefix-cache-mb", "-1"], "prefix_cache_mb must be >= 0"),
    (["eval-drafter", "--drafter", "{root}/missing", "--sets", "heldout,mmlu"], "unknown prompt set 'mmlu'"),
    (["eval-drafter", "--drafter", "{root}/missing", "--temperature", "-1"], "--temperature must be 0 or more"),
    (["eval-drafter", "--drafter", "{root}/missing", "--seeds", "0,x"], "--seeds must be comma-separated"),
    (["eval-drafter", "--drafter", "{root}/missing", "--widths", "15,wide"], "--widths must be comma-separated"),
    (["train-drafter", "--data", "{root}/missing", "--out", "{root}/run", "--taps", "1,a"],
     "--taps must be comma-separated"),
    (["train-drafter", "--data", "{root}/missing", "--out", "{root}/run", "--context-window", "8"],
     "expected WINDOW:UNTIL_STEP"),
])
def test_serving_commands_reject_bad_input_in_one_line(dirs, capsys, argv, message):
    code, out, err = run_cli(capsys, *[a.format(root=dirs) for a in argv])
    assert code == 2 and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_a_probe_of_a_few_shapes_leaves_the_deployments_profile_alone(dirs, capsys, tmp_path, monkeypatch):
    """`castspec probe` stores its profile for width="auto" only when it measures what the rules read (packed
    counts 1 to 64); a narrower probe says so and stores nothing unless asked (--store)."""
    monkeypatch.setenv("CASTSPEC_CACHE", str(tmp_path))
    model = ["--target", str(dirs / "target"), "--drafter", str(dirs / "drafter"), "--dtype", "fp32"]
    small = ["probe", *model, "--packed", "1,2", "--prefix-lens", "8", "--reps", "1", "--warmup", "0"]
    code, out, err = run_cli(capsys, *small)
    assert code == 0 and json.loads(out)["profile"] is None and "not stored" in err
    assert not list(tmp_path.rglob("*.json"))
    code, out, _ = run_cli(capsys, *small, "--store")
    stored = json.loads(out)["profile"]
    assert code == 0 and stored.startswith(str(tmp_path)) and json.loads(open(stored).read())["packed"] == [1, 2]
    code, out, err = run_cli(capsys, "probe", *model, "--packed", "1,2,4,8,16,32,64", "--prefix-lens", "8",
                             "--reps", "1", "--warmup", "0")
    assert code == 0 and json.loads(out)["profile"] == stored and "not stored" not in err
    assert json.loads(open(stored).read())["packed"] == [1, 2, 4, 8, 16, 32, 64]
