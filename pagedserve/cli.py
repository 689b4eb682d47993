"""The `pagedserve` command: backends, generate, serve, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from pagedserve.arg_utils import add_engine_args, make_llm
from pagedserve.bench import add_bench_parser
from pagedserve.server.cli import add_serve_parser


def _cmd_backends(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.attention.registry import AUTO_ORDER, backend_status, get_backend_cls

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    rows = [("backend", "available", "head sizes", "dtypes", "features", "details")]
    for name, (ok, why) in backend_status().items():
        try:
            cls = get_backend_cls(name)
            heads = ",".join(map(str, cls.supported_head_sizes)) or "any"
            dtypes = ",".join(str(d).removeprefix("torch.") for d in cls.supported_dtypes)
            features = ",".join(cls.features()) or "-"
        except Exception:  # the import failure is already in `why`
            heads = dtypes = features = "?"
        rows.append((name, "yes" if ok else "no", heads, dtypes, features, why))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row[:5], widths, strict=False)),
              row[5], sep="  ")
    print(f"\ndevice: {device}; auto-selection order: "
          f"{' > '.join(AUTO_ORDER.get(device.type, ()))}")
    return 0


SAMPLING_FLAGS = [
    ("--max-tokens", int), ("--temperature", float), ("--top-p", float), ("--top-k", int),
    ("--min-p", float), ("--sample-seed", int), ("--stop", str),
]


def _cmd_generate(args: argparse.Namespace) -> int:
    from pagedserve.sampling_params import SamplingParams

    if (args.prompt is None) == (args.input is None):
        raise SystemExit("pagedserve generate: error: give exactly one of --prompt or --input")
    llm = make_llm(args)
    if args.prompt is not None:
        fields = {"max_tokens": args.max_tokens, "temperature": args.temperature,
                  "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p,
                  "seed": args.sample_seed, "stop": args.stop}
        try:
            params = SamplingParams.from_dict({k: v for k, v in fields.items() if v is not None})
        except ValueError as exc:
            raise SystemExit(f"pagedserve generate: error: {exc}") from None
        prompt: Any = args.prompt
        if args.chat:
            prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
        try:
            output = llm.generate(prompt, params, use_tqdm=False)[0]
        except ValueError as exc:
            raise SystemExit(f"pagedserve generate: error: {exc}") from None
        print(output.outputs[0].text)
        return 0
    return _generate_file(llm, args.input, args.output)


def _generate_file(llm, input_path: str, output_path: str | None) -> int:
    """Each line of a JSONL file: {"prompt": ...} or {"messages": [...]}, plus sampling fields.
    A bad line is reported on stderr (line number and field) and skipped; the rest run."""
    ids: list[str] = []
    lines: dict[str, int] = {}
    errors = 0
    with open(input_path) as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                request_id = f"line-{number}"
                prompt, params = parse_request_line(llm, raw)
                llm.engine.add_request(request_id, prompt, params, stream=False)
            except ValueError as exc:
                errors += 1
                print(f"{input_path}:{number}: {exc}", file=sys.stderr)
                continue
            ids.append(request_id)
            lines[request_id] = number
    results = llm.wait_for(ids, use_tqdm=True)
    out = open(output_path, "w") if output_path else sys.stdout
    try:
        for result in results:
            completion = result.outputs[0]
            prompt = result.prompt
            if prompt is None and llm.tokenizer is not None:  # chat or token-id prompts
                prompt = llm.tokenizer.decode(result.prompt_token_ids)
            record = {"line": lines[result.request_id], "prompt": prompt,
                      "text": completion.text, "token_ids": completion.token_ids,
                      "finish_reason": completion.finish_reason}
            if len(result.outputs) > 1:
                record["texts"] = [o.text for o in result.outputs]
            out.write(json.dumps(record) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    if errors:
        print(f"{errors} line(s) skipped", file=sys.stderr)
    return 1 if errors and not ids else 0


def parse_request_line(llm, raw: str):
    from pagedserve.sampling_params import SamplingParams

    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(record, dict):
        raise ValueError("each line must be a JSON object")
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    if has_messages:
        messages = record.pop("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("field 'messages' must be a list of {role, content} objects")
        prompt = llm.apply_chat_template(messages)
    else:
        prompt = record.pop("prompt")
        if not isinstance(prompt, str) and not (
                isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
            raise ValueError("field 'prompt' must be a string or a list of token ids")
    return prompt, SamplingParams.from_dict(record)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description=__doc__)
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list attention backends and whether they run here")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("generate", help="offline generation: one prompt or a JSONL file")
    p.add_argument("--prompt", help="one prompt; prints its completion")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    p.add_argument("--input", help="JSONL file: one request per line")
    p.add_argument("--output", help="JSONL results (default: stdout)")
    sampling = p.add_argument_group("sampling (with --prompt)")
    for flag, typ in SAMPLING_FLAGS:
        sampling.add_argument(flag, type=typ)
    add_engine_args(p)
    p.set_defaults(func=_cmd_generate)

    add_serve_parser(sub)
    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
