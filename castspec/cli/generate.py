"""`castspec generate`: decode one prompt with ar, chain or cast."""
from __future__ import annotations

import json
import sys

from .common import UserError, add_decode_args, add_model_args, check_decode_args, decode_kwargs, load_engine


def cmd_generate(args) -> int:
    check_decode_args(args)
    sources = [x is not None for x in (args.prompt, args.messages, args.input_ids)]
    if sum(sources) != 1:
        raise UserError("give exactly one of --prompt, --messages (JSON list) or --input-ids")
    messages = input_ids = None
    if args.messages is not None:
        try:
            messages = json.loads(args.messages)
        except json.JSONDecodeError as e:
            raise UserError(f"--messages is not valid JSON: {e}") from None
    if args.input_ids is not None:
        try:
            input_ids = [int(t) for t in args.input_ids.replace(",", " ").split()]
        except ValueError:
            raise UserError("--input-ids must be integers separated by commas or spaces") from None
    engine = load_engine(args)
    result = engine.generate(prompt=args.prompt, messages=messages, input_ids=input_ids, **decode_kwargs(args))
    if args.json:
        out = result.to_dict()
        out["dtype"] = engine.dtype_reason
        out["exactness"] = {"guarantee": engine.exactness, "reason": engine.exactness_reason}
        print(json.dumps(out, indent=2))
    else:
        print(result.text)
        s = result.stats
        print(f"[{result.method} width={result.width} | {s.new_tokens} tokens, R={s.mean_accepted:.2f}, "
              f"{s.decode_ms_per_token:.1f} ms/token decode, {engine.dtype_reason}]", file=sys.stderr)
    return 0


def register(sub) -> None:
    g = sub.add_parser("generate", help="decode one prompt with ar, chain or cast",
                       description="Decode one prompt; greedy output is exactly the target's.")
    g.add_argument("--prompt", default=None, help="raw text prompt")
    g.add_argument("--messages", default=None, help='chat messages as JSON, e.g. [{"role":"user","content":"Hi"}]')
    g.add_argument("--input-ids", default=None, help="token ids, used as given")
    g.add_argument("--json", action="store_true", help="print the result and statistics as JSON")
    add_model_args(g)
    add_decode_args(g)
    g.set_defaults(func=cmd_generate)
