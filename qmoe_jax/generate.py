"""Generate text with a T5X or compressed SwitchTransformer (T5 span infilling).

    python -m qmoe_jax.generate --checkpoint runs/compressed/switch-mini-8 \\
        --prompt "To be, or not to be, <extra_id_0> is the question."
    python -m qmoe_jax.generate --checkpoint runs/compressed/switch-mini-8 \\
        --input_file prompts.jsonl --decoding beam --beam_size 4 --output_file out.jsonl
    python -m qmoe_jax.generate --checkpoint runs/mapped/switch-mini-8 --experts mapped \\
        --prompt "..."

A mapped checkpoint (``python -m qmoe_jax.convert --layout mmap``) keeps the
expert codes on disk until routed tokens touch them (``--verify``,
``--expert_cache_gb``), so a model larger than RAM generates.

Prompts use T5's sentinel syntax: ``<extra_id_0>``, ``<extra_id_1>``, ... mark
the spans the model fills; Switch models are trained on exactly this task.
Each output line is JSON: ``{"inputs", "generated", "tokens", "score"}``.
Across several processes (docs/multihost.md) process 0 writes them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time

from qmoe_jax.checkpoints import strict_json
from qmoe_jax.cli import add_debug_flag, finite_float, run_cli
from qmoe_jax.data import Tokenizer, bundled
from qmoe_jax.distributed import runtime as distributed_runtime
from qmoe_jax.inference import add_model_arguments, open_model_from_args
from qmoe_jax.inference.generation import (
    check_attention_memory,
    encode_prompts,
    generate_encoded,
)
from qmoe_jax.inference.strategies import METHODS, DecodingConfig


def read_prompts(path: str) -> list[str]:
    """The ``inputs`` field of each JSON line of ``path``."""
    prompts = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompt = str(json.loads(line)["inputs"])
            except (ValueError, KeyError, TypeError):
                raise ValueError(
                    f'{path}:{number} is not a JSON object with an "inputs" field'
                ) from None
            if not prompt.strip():
                raise ValueError(f'{path}:{number} has an empty "inputs" field; give it a prompt')
            prompts.append(prompt)
    return prompts


def generate(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m qmoe_jax.generate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--input_file", help='JSON lines with an "inputs" field')
    parser.add_argument("--output_file", help="write JSON lines here (default: standard output)")
    parser.add_argument("--decoding", choices=METHODS, default="greedy")
    parser.add_argument("--max_decode_length", type=int, default=32)
    parser.add_argument("--temperature", type=finite_float, default=1.0)
    parser.add_argument(
        "--top_k", type=int, default=0, help="sample from the k most likely tokens (0: off)"
    )
    parser.add_argument(
        "--top_p", type=finite_float, default=1.0, help="nucleus sampling mass (1.0: off)"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--beam_size", type=int, default=4)
    parser.add_argument(
        "--alpha",
        type=finite_float,
        default=0.6,
        help="beam search brevity penalty exponent (T5X: 0.6)",
    )
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument(
        "--inputs_length",
        type=int,
        help="encoder length (default: the longest prompt rounded up to 8, which may have at "
        "most 512 tokens; a longer one needs an explicit --inputs_length)",
    )
    add_debug_flag(parser)
    distributed_runtime.add_flags(parser)
    args = parser.parse_args(argv)
    if bool(args.prompt) == bool(args.input_file):
        parser.error("give --prompt (repeatable) or --input_file, not both and not neither")
    if any(not prompt.strip() for prompt in args.prompt):
        parser.error(
            '--prompt is empty; give the text to continue, e.g. --prompt "The <extra_id_0> walks '
            'in the park."'
        )
    for flag in ("batch_size", "inputs_length"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    try:
        config = DecodingConfig(
            method=args.decoding,
            max_decode_length=args.max_decode_length,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            beam_size=args.beam_size,
            alpha=args.alpha,
        )
    except ValueError as error:
        parser.error(str(error))

    prompts = args.prompt or read_prompts(args.input_file)
    if not prompts:
        raise ValueError(f"{args.input_file} holds no prompts")
    tokenizer = Tokenizer(args.tokenizer or bundled.tokenizer_path())
    tokens = encode_prompts(tokenizer, prompts, args.inputs_length)  # bounded before any work
    model = open_model_from_args(args)
    check_attention_memory(model.config, args.batch_size, tokens.shape[1])
    started, generated_tokens = time.perf_counter(), 0
    lead = distributed_runtime.is_lead()  # every process decodes; process 0 writes the results
    with contextlib.ExitStack() as stack:
        out = sys.stdout
        if args.output_file and lead:
            out = stack.enter_context(open(args.output_file, "w"))
        if model.residency is not None:
            stack.enter_context(model.residency.errors())
        for result in generate_encoded(
            model.module,
            model.params,
            tokenizer,
            prompts,
            tokens,
            config,
            args.batch_size,
            args.seed,
            progress=bool(args.input_file) and sys.stderr.isatty() and lead,
        ):
            generated_tokens += len(result.tokens)
            if not lead:
                continue
            line = {
                "inputs": result.inputs,
                "generated": result.text,
                "tokens": result.tokens,
                "score": round(result.score, 6),
            }
            out.write(strict_json.dumps(line, what="a generated line") + "\n")
            out.flush()
    seconds = time.perf_counter() - started
    distributed_runtime.lead_only(print)(
        f"{len(prompts)} prompt(s), {generated_tokens} tokens in {seconds:.1f} s including "
        "compilation "
        f"({model.experts} experts, {config.method})",
        file=sys.stderr,
    )


def main(argv=None) -> None:
    run_cli(generate, argv)


if __name__ == "__main__":
    main()
