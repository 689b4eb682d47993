"""`pagedserve generate`: offline generation from the command line, one prompt or a JSONL file.

Everything that can be wrong with the input (a missing file, a bad line, a bad sampling flag)
is reported before the model loads. A bad line is reported with its number and skipped; the
others run, and the exit status is 1 so that a script can tell.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Any

from pagedserve.arg_utils import (
    HelpFormatter,
    add_config_flags,
    add_engine_args,
    check_output_file,
    checked_engine_config,
    given_fields,
    make_llm,
)
from pagedserve.sampling_params import SamplingParams

SAMPLING_DEST = "sampling_"


@dataclass
class Job:
    """One request of the run: where it came from and what it asks."""

    line: int | None  # in the input file; None for --prompt
    prompt: str | list[int] | None  # None: a chat (messages)
    messages: list[dict[str, Any]] | None
    sampling: dict[str, Any]  # the flags' and the line's sampling fields (checked)
    lora: str | None = None  # the adapter of --lora-modules it runs through (None: the base)
    chat_template_kwargs: dict[str, Any] | None = None  # a chat's template variables

    def params(self, model_defaults: dict[str, Any]) -> SamplingParams:
        """Its SamplingParams over the model's recommended settings."""
        return SamplingParams(**{**model_defaults, **self.sampling})


def add_generate_parser(subparsers: Any, parents: list[Any] | None = None
                        ) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "generate", parents=parents or [], formatter_class=HelpFormatter,
        help="offline generation: one prompt or a JSONL file",
        description="Generate for one --prompt, or for every line of an --input JSONL file "
                    "({\"prompt\": ...} or {\"messages\": [...]} plus any sampling field).")
    p.add_argument("--prompt", help="one prompt; prints its completion")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    p.add_argument("--input", help="JSONL file, one request per line")
    p.add_argument("--output", help="write JSONL results to this file ('-': stdout) instead "
                                    "of printing the answers")
    p.add_argument("--lora", metavar="NAME", help="generate through this adapter of "
                   "--lora-modules (an --input line's 'lora' field picks its own)")
    sampling = p.add_argument_group(
        "sampling", "defaults for every request; an --input line's own fields win")
    add_config_flags(sampling, SamplingParams, dest_prefix=SAMPLING_DEST)
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run_generate)
    return p


def run_generate(args: argparse.Namespace) -> int:
    if (args.prompt is None) == (args.input is None):
        raise SystemExit("pagedserve generate: error: give exactly one of --prompt or --input")
    check_output_file(args.output, "--output", "generate")
    config = checked_engine_config(args)
    defaults = given_fields(args, SamplingParams, SAMPLING_DEST)
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"pagedserve generate: error: {exc}") from None
    if args.prompt is not None:
        messages = [{"role": "user", "content": args.prompt}] if args.chat else None
        jobs = [Job(None, None if args.chat else args.prompt, messages, defaults)]
        errors = 0
    else:
        jobs, errors = read_jobs(args.input, defaults)
    adapters = {r.lora_name: r for r, _ in config.lora.startup_adapters()}
    if args.lora is not None and args.lora not in adapters:
        raise SystemExit("pagedserve generate: error: --lora "
                         + _unknown_adapter(args.lora, adapters))
    runnable = []
    for job in jobs:
        job.lora = job.lora or args.lora
        if job.lora is not None and job.lora not in adapters:
            errors += 1
            print(f"{args.input}:{job.line}: lora {_unknown_adapter(job.lora, adapters)}",
                  file=sys.stderr)
        else:
            runnable.append(job)
    jobs = runnable
    llm = make_llm(config)
    results = run_jobs(llm, jobs, args.input, adapters)
    if args.output is not None:
        write_jsonl(llm, results, args.output)
    elif args.prompt is not None:
        for _, output in results:
            for completion in output.outputs:
                print(completion.text)
    else:
        print_answers(llm, results)
    errors += len(jobs) - len(results)
    if errors:
        print(f"pagedserve generate: {errors} request(s) failed, see above", file=sys.stderr)
    return 1 if errors else 0


def _unknown_adapter(name: str, adapters: dict[str, Any]) -> str:
    given = ", ".join(adapters) or "none (add --enable-lora --lora-modules NAME=PATH)"
    return f"{name!r} is no adapter of --lora-modules (they are: {given})"


def read_jobs(path: str, defaults: dict[str, Any]) -> tuple[list[Job], int]:
    """The file's requests and the number of bad lines (each reported on stderr)."""
    try:
        with open(path) as f:
            raw_lines = f.readlines()
    except OSError as exc:
        raise SystemExit(f"pagedserve generate: error: --input {path}: {exc.strerror}") from None
    jobs, errors = [], 0
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        try:
            jobs.append(parse_request_line(raw, defaults, number))
        except ValueError as exc:
            errors += 1
            print(f"{path}:{number}: {exc}", file=sys.stderr)
    return jobs, errors


def parse_request_line(raw: str, defaults: dict[str, Any] | None = None,
                       number: int | None = None) -> Job:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"malformed JSON: {exc.msg} at column {exc.colno}") from None
    if not isinstance(record, dict):
        raise ValueError("each line must be a JSON object")
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        raise ValueError("give exactly one of 'prompt' or 'messages'")
    prompt, messages = None, None
    if has_messages:
        messages = record.pop("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("field 'messages' must be a list of {role, content} objects")
    else:
        prompt = record.pop("prompt")
        if not isinstance(prompt, str) and not (
                isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            raise ValueError("field 'prompt' must be a string or a list of token ids")
    lora = record.pop("lora", None)
    if lora is not None and not isinstance(lora, str):
        raise ValueError("field 'lora' must be the name of an adapter of --lora-modules")
    template_kwargs = record.pop("chat_template_kwargs", None)
    if template_kwargs is not None and not (has_messages and isinstance(template_kwargs, dict)):
        raise ValueError("field 'chat_template_kwargs' must be an object, on a 'messages' line")
    sampling = {**(defaults or {}), **record}
    SamplingParams.from_dict(sampling)  # its errors, before anything loads
    return Job(number, prompt, messages, sampling, lora, template_kwargs)


def run_jobs(llm: Any, jobs: list[Job], source: str | None,
             adapters: dict[str, Any] | None = None) -> list[tuple[Job, Any]]:
    """Add every job to the engine (a job the engine refuses is reported and skipped), then
    step until all finish; (job, RequestOutput) in input order. `adapters`: LoRARequests by
    name, for the jobs' `lora`."""
    ids: dict[str, Job] = {}
    for i, job in enumerate(jobs):
        try:
            prompt, images = job.prompt, None
            if job.messages is not None:  # images in content parts too (they were dropped)
                chat = llm.chat_prompt(job.messages,
                                       chat_template_kwargs=job.chat_template_kwargs)
                prompt, images = chat["prompt_token_ids"], chat.get("multi_modal_data")
            request_id = f"line-{job.line}" if job.line is not None else str(i)
            lora = (adapters or {}).get(job.lora) if job.lora is not None else None
            llm.engine.add_request(request_id, prompt, job.params(llm.engine.default_sampling),
                                   stream=False, lora_request=lora, multi_modal_data=images)
        except ValueError as exc:
            where = f"{source}:{job.line}" if job.line is not None else "pagedserve generate"
            print(f"{where}: {exc}", file=sys.stderr)
            continue
        ids[request_id] = job
    outputs = llm.wait_for(list(ids), use_tqdm=len(ids) > 1)
    return [(ids[o.request_id], o) for o in outputs]


def _prompt_text(llm: Any, job: Job, output: Any) -> str:
    if job.messages is not None:
        contents = [m.get("content") for m in job.messages if m.get("role") == "user"]
        if not contents:
            return ""
        if isinstance(contents[-1], list):  # content parts: their text, an image as [image]
            return " ".join(p.get("text", "") if p.get("type") == "text" else "[image]"
                            for p in contents[-1] if isinstance(p, dict))
        return str(contents[-1])
    if isinstance(job.prompt, str):
        return job.prompt
    return llm.tokenizer.decode(output.prompt_token_ids) if llm.tokenizer else str(job.prompt)


def print_answers(llm: Any, results: list[tuple[Job, Any]]) -> None:
    """What a person reads: each prompt, then its answer(s)."""
    for job, output in results:
        print(f"[{job.line}] {_prompt_text(llm, job, output).strip()}")
        for completion in output.outputs:
            text = completion.text.strip() or "(no text)"
            print(("  " if len(output.outputs) > 1 else "") + text)
        print()


def write_jsonl(llm: Any, results: list[tuple[Job, Any]], path: str) -> None:
    """One record per request: its first sample's text, token ids and finish reason at the
    top, with its logprobs when asked for; n > 1 lists every sample under "completions"."""
    out = sys.stdout if path == "-" else open(path, "w")
    try:
        for job, output in results:
            prompt = output.prompt
            if prompt is None and llm.tokenizer is not None:  # chat or token-id prompts
                prompt = llm.tokenizer.decode(output.prompt_token_ids)
            samples = [_sample_record(c) for c in output.outputs]
            record = {"line": job.line, "prompt": prompt, **samples[0]}
            if output.prompt_logprobs is not None:
                record["prompt_logprobs"] = [_position_record(p) for p in output.prompt_logprobs]
            if len(samples) > 1:
                record["texts"] = [o.text for o in output.outputs]
                record["completions"] = samples
            out.write(json.dumps(record) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()


def _sample_record(completion: Any) -> dict[str, Any]:
    record = {"text": completion.text, "token_ids": list(completion.token_ids),
              "finish_reason": completion.finish_reason}
    if completion.logprobs is not None:
        record["logprobs"] = [_position_record(p) for p in completion.logprobs]
        record["cumulative_logprob"] = completion.cumulative_logprob
    return record


def _position_record(position: Any) -> dict[str, Any] | None:
    """{token id (a JSON key, so a string): {"logprob", "rank", "token"}} of one position."""
    if position is None:
        return None
    return {str(token): {"logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
            for token, lp in position.items()}
