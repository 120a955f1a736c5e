"""The ``eyas`` command: ``generate`` (streams to the terminal), ``chat`` (interactive) and ``bench``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time


def _engine_args(parser: argparse.ArgumentParser, speculative: bool = True) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF folder or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                   help="auto = bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    g.add_argument("--quantization", default="auto", choices=["auto", "gguf", "int8", "bf16", "none"],
                   help="weight format: auto = a GGUF model keeps its block formats on a CPU (gguf), an HF folder "
                        "gets bfloat16 weights on a CPU with native bf16 (bf16), anything else the engine dtype; "
                        "gguf = the GGUF file's own formats (CPU); int8 = per-output-channel int8 made at load (CPU); "
                        "bf16 = bfloat16 weights with float32 activations (CPU); none = the engine dtype")
    g.add_argument("--matmul-precision", default="auto", choices=["auto", "highest", "medium", "low"],
                   help="products of the CPU weight formats: highest = float32; medium = activations and weights "
                        "rounded to bfloat16, float32 sums (CPUs with AVX512-BF16; faster past a few rows); "
                        "low = activations quantized to int8 per block of 32 (q/k/v: two int8 terms), integer dot "
                        "products (VNNI), as llama.cpp; auto = low for a Q4_0/Q4_1/Q8_0 GGUF on a CPU with VNNI, "
                        "else medium where the CPU's bf16 dot products outrun its float32 FMAs, else highest")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=64)
    g.add_argument("--max-num-batched-tokens", type=int, default=2048)
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="memory budget of the paged KV cache")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    if not speculative:
        return
    s = parser.add_argument_group("speculative decoding")
    from eyas.spec_decode.registry import option_fields, proposer_methods

    s.add_argument("--spec-method", default=None, choices=proposer_methods(), help="drafting method (default: none)")
    s.add_argument("--spec-tokens", type=int, default=None,
                   help="draft tokens per step (k); default: the checkpoint's (speculators folders), the longest draft "
                        "the suffix trees allow (suffix), else 4")
    s.add_argument("--spec-verification", default=None, choices=["rejection", "shared_noise"])
    for key, f in option_fields().items():  # each method's options, with the flags its Options declare
        flag, text = f.metadata["flag"], f.metadata["help"]
        if flag is None:
            continue
        if isinstance(f.default, bool):
            s.add_argument(flag, dest=f"spec:{key}", action="store_true", default=None, help=text)
        else:
            s.add_argument(flag, dest=f"spec:{key}", type=f.metadata["parse"], default=None, help=text)


def _sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    # None: the model's default (generation_config.json; the built-in model: temperature 0.2, top_p 0.9,
    # repetition penalty 1.1, as its card recommends and as measured), else vLLM's
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
    g.add_argument("--top-p", type=float, default=None, help="(default: the model's)")
    g.add_argument("--top-k", type=int, default=None, help="(default: the model's, else off)")
    g.add_argument("--min-p", type=float, default=None, help="(default: the model's, else off)")
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="> 1 discourages tokens of the prompt and the output so far (1 = off; default: the model's)")
    g.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once per token already output")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="subtracted per occurrence in the output")
    g.add_argument("--json-schema", default=None, metavar="FILE",
                   help="structured output: every answer is JSON valid under the schema in FILE")


def _spec_config(args) -> dict | None:
    if args.spec_method is None:
        return None
    from eyas.spec_decode.registry import option_fields, proposer_class

    config = {"method": args.spec_method}
    if args.spec_verification is not None:
        config["verification"] = args.spec_verification
    config.update({key: getattr(args, f"spec:{key}") for key in option_fields() if getattr(args, f"spec:{key}", None) is not None})
    if args.spec_tokens is not None:
        config["num_speculative_tokens"] = args.spec_tokens
    elif proposer_class(args.spec_method).default_num_speculative_tokens(config) is None:
        config["num_speculative_tokens"] = 4
    return config


def _engine_kwargs(args) -> dict:
    """The engine group's flags as ``LLM`` keyword arguments (every command that builds an engine)."""
    return dict(dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, kv_cache_gb=args.kv_cache_gb,
                enable_prefix_caching=not args.no_prefix_caching, num_threads=args.threads,
                enforce_eager=args.enforce_eager, quantization=None if args.quantization == "none" else args.quantization,
                matmul_precision=args.matmul_precision)


def _make_llm(args):
    from eyas import LLM

    return LLM(args.model, max_model_len=args.max_model_len, speculative_config=_spec_config(args),
               **_engine_kwargs(args))


def _spec_line(metrics: dict) -> str:
    if not metrics.get("num_steps"):
        return ""
    per_position = " ".join(f"{a:.2f}" for a in metrics["per_position_acceptance"])
    return (f"speculation: drafted {metrics['num_drafted']}, accepted {metrics['num_accepted']} "
            f"({metrics['acceptance_rate']:.0%}), mean acceptance length {metrics['mean_acceptance_length']:.2f}, "
            f"per position [{per_position}]")


def _params(llm, args):
    from eyas import SamplingParams

    given = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                 repetition_penalty=args.repetition_penalty)
    kw = {**llm.sampling_defaults, **{k: v for k, v in given.items() if v is not None}}
    structured = None
    if args.json_schema is not None:
        try:
            with open(args.json_schema, encoding="utf-8") as f:
                structured = {"json": json.load(f)}
        except (OSError, ValueError) as error:
            raise ValueError(f"--json-schema: cannot read a JSON schema from {args.json_schema} ({error})") from None
    return SamplingParams(max_tokens=args.max_tokens, seed=args.seed, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, structured_output=structured, **kw)


def _render(llm, messages: list[dict] | str, raw: bool = False) -> list[int]:
    """Token ids of a raw prompt, or of a conversation rendered with the chat template (no extra BOS)."""
    tok = llm.get_tokenizer()
    if raw or tok.chat_template is None:
        return tok.encode(messages if isinstance(messages, str) else messages[-1]["content"])
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True), add_special_tokens=False)


def cmd_generate(args) -> int:
    with _make_llm(args) as llm:
        params = _params(llm, args)
        prompts = list(args.prompt)
        if args.prompts_file:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            print("eyas generate: give a prompt (or --prompts-file)", file=sys.stderr)
            return 2
        if len(prompts) > 1:  # a batch: progress bar, then every answer
            outs = llm.generate([_render(llm, p, args.raw) for p in prompts], params)
            for p, o in zip(prompts, outs):
                print(f"### {p}\n{o.outputs[0].text}\n")
                if o.hidden_states_path:
                    print(f"[hidden states: {o.hidden_states_path}]", file=sys.stderr)
            if _spec_line(llm.stats()):
                print(_spec_line(llm.stats()), file=sys.stderr)
            return 0
        text = ""
        out = None
        for out in llm.stream(_render(llm, prompts[0], args.raw), params):
            delta = out.outputs[0].text[len(text):]
            text = out.outputs[0].text
            print(delta, end="", flush=True)
        print()
        if out is not None and not args.quiet:
            m, n = out.metrics, len(out.outputs[0].token_ids)
            tpot = m.time_per_output_token
            print(f"[{n} tokens, finish={out.outputs[0].finish_reason}, ttft={m.time_to_first_token * 1e3:.0f} ms"
                  + (f", {1 / tpot:.1f} tok/s decode]" if tpot else "]"), file=sys.stderr)
            if _spec_line(out.spec_metrics):
                print(f"[{_spec_line(out.spec_metrics)}]", file=sys.stderr)
            if out.hidden_states_path:
                print(f"[hidden states: {out.hidden_states_path}]", file=sys.stderr)
        return 0


def cmd_chat(args) -> int:
    with _make_llm(args) as llm:
        params = _params(llm, args)
        history = [{"role": "system", "content": args.system}] if args.system else []
        print("eyas chat: type a message, empty line or Ctrl-D to quit, /reset to start over.")
        while True:
            try:
                line = input("> ").strip()
            except EOFError:
                print()
                return 0
            if not line:
                return 0
            if line == "/reset":
                history = history[:1] if args.system else []
                continue
            history.append({"role": "user", "content": line})
            text = ""
            for out in llm.stream(_render(llm, history), params):
                delta = out.outputs[0].text[len(text):]
                text = out.outputs[0].text
                print(delta, end="", flush=True)
            print()
            history.append({"role": "assistant", "content": text})


def cmd_bench(args) -> int:
    from eyas.data.prompts import chat_prompts

    with _make_llm(args) as llm:
        prompts = [_render(llm, c) for c in chat_prompts(args.num_prompts)]
        params = dataclasses.replace(_params(llm, args), ignore_eos=True)
        warmup = dataclasses.replace(params, max_tokens=4)
        llm.generate(prompts[: min(2, len(prompts))], warmup, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
        ttft = sorted(o.metrics.time_to_first_token for o in outs)
        print(f"requests: {len(outs)}  prompt tokens: {prompt_tokens}  generated tokens: {generated}")
        print(f"elapsed: {elapsed:.2f} s  output throughput: {generated / elapsed:.1f} tok/s  "
              f"total throughput: {(generated + prompt_tokens) / elapsed:.1f} tok/s")
        print(f"median time to first token: {ttft[len(ttft) // 2] * 1e3:.0f} ms")
        if _spec_line(llm.stats()):
            print(_spec_line(llm.stats()))
        return 0


def cmd_serve(args) -> int:
    import os

    from eyas.server import ServerSettings, serve

    if args.max_waiting is not None and args.max_waiting < 1:
        raise ValueError(f"--max-waiting: {args.max_waiting} must be >= 1")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port: {args.port} must be in [0, 65535]")
    with _make_llm(args) as llm:
        name = args.served_model_name or (args.model if args.model else "SmolLM2-135M-Instruct")
        settings = ServerSettings(name, api_key=args.api_key or os.environ.get("EYAS_API_KEY") or None,
                                  max_waiting=args.max_waiting,
                                  per_request_spec_metrics=args.per_request_spec_metrics)
        serve(llm, settings, args.host, args.port)
        return 0


def _reply_sampling_args(p, prefix: str = "") -> None:
    """Sampled regenerated replies: `eyas regenerate` and `eyas extract --regenerate` (``prefix`` opens --temperature's
    help)."""
    p.add_argument("--temperature", type=float, default=0.0,
                   help=f"{prefix}0 = greedy replies (the default); above 0 the replies are sampled (SpecForge's "
                        "regeneration example uses 0.8), which covers more of the target's distribution")
    p.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    p.add_argument("--top-k", type=int, default=0, help="with --temperature: the k most likely tokens (0 = all)")
    p.add_argument("--seed", type=int, default=0,
                   help="with --temperature: each reply is drawn with its own seed made from this one, the "
                        "conversation's index and the turn, so a resumed job writes what an uninterrupted one would")


def cmd_extract(args) -> int:
    from eyas.jobs.extract import run_extract

    manifest = run_extract(args.data, args.out, model=args.model, layers=args.layers, regenerate=args.regenerate,
                           max_samples=args.max_samples, max_len=args.max_len,
                           max_turns=args.max_turns, regen_max_tokens=args.regen_max_tokens, chunk_size=args.chunk_size,
                           temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                           **_engine_kwargs(args))
    print(f"{manifest['num_samples']} samples ({manifest['num_skipped']} skipped), {manifest['num_tokens']} tokens "
          f"({manifest['num_loss_tokens']} with loss) in {args.out}; manifest: {args.out}/manifest.json")
    return 0


def cmd_regenerate(args) -> int:
    from eyas.jobs.regenerate import run_regenerate

    counts = run_regenerate(args.data, args.out, model=args.model, max_samples=args.max_samples,
                            max_turns=args.max_turns, max_tokens=args.max_tokens, max_len=args.max_len,
                            chunk_size=args.chunk_size, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, **_engine_kwargs(args))
    print(f"{counts['written']} conversations ({counts['skipped']} skipped), {counts['replies']} replies "
          f"({counts['truncated']} cut at --max-tokens) in {args.out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from eyas.spec_decode.extract_hidden_states import parse_layer_ids

    parser = argparse.ArgumentParser(prog="eyas", description="eyas: a compact LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from prompts, streaming to the terminal")
    gen.add_argument("prompt", nargs="*", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--prompts-file", help="a file with one prompt per line")
    gen.add_argument("--raw", action="store_true", help="do not wrap the prompt in the chat template")
    gen.add_argument("--quiet", action="store_true", help="no timing line")
    _engine_args(gen)
    _sampling_args(gen, max_tokens=256)
    gen.set_defaults(func=cmd_generate)
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--system", default=None, help="system message")
    _engine_args(chat)
    _sampling_args(chat, max_tokens=512)
    chat.set_defaults(func=cmd_chat)
    bench = sub.add_parser("bench", help="throughput on real ShareGPT chat prompts")
    bench.add_argument("--num-prompts", type=int, default=32)
    _engine_args(bench)
    _sampling_args(bench, max_tokens=128)
    bench.set_defaults(func=cmd_bench)
    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                                       "/metrics, a playground page at /)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=8000)
    srv.add_argument("--api-key", default=None,
                     help="require 'Authorization: Bearer KEY' on /v1 routes (default: $EYAS_API_KEY, else none)")
    srv.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    srv.add_argument("--max-waiting", type=int, default=None,
                     help="answer 503 with Retry-After once this many requests wait (default: no limit)")
    srv.add_argument("--per-request-spec-metrics", action="store_true",
                     help="each response carries its own drafted/accepted/per-position figures (spec_decode_metrics)")
    _engine_args(srv)
    srv.set_defaults(func=cmd_serve)
    ext = sub.add_parser("extract", help="dump the target's hidden states of chat data for drafter training "
                                         "(resumable: re-run the same command after a crash)")
    ext.add_argument("--data", required=True,
                     help="ShareGPT .json, .jsonl of conversations, or 'sharegpt' for the shipped ShareGPT file")
    ext.add_argument("--out", required=True, help="output folder (files, samples.jsonl journal, manifest.json)")
    ext.add_argument("--layers", type=parse_layer_ids, default=None,
                     help="aux layer ids, vLLM convention (default: 2,N//2,N-3)")
    ext.add_argument("--regenerate", action="store_true",
                     help="replace the replies by the target's own, greedy or sampled (self-distillation); the last "
                          "one's states are dumped while it is generated")
    ext.add_argument("--max-turns", type=int, default=None,
                     help="keep each conversation's first N exchanges (user turn and reply); default: all")
    ext.add_argument("--max-samples", type=int, default=None, help="use the first N conversations")
    ext.add_argument("--max-len", type=int, default=None,
                     help="cut conversations to this many tokens (default: 2048 or the model's limit)")
    ext.add_argument("--regen-max-tokens", type=int, default=512, help="longest regenerated reply")
    ext.add_argument("--chunk-size", type=int, default=128, help="conversations per journaled chunk")
    _reply_sampling_args(ext, "with --regenerate: ")
    _engine_args(ext, speculative=False)
    ext.set_defaults(func=cmd_extract)
    reg = sub.add_parser("regenerate", help="replace the replies of chat data by the target's own (greedy or sampled) "
                                            "into a .jsonl for `eyas extract` or `eyas train --online` (resumable)")
    reg.add_argument("--data", required=True,
                     help="ShareGPT .json, .jsonl of conversations, or 'sharegpt' for the shipped ShareGPT file")
    reg.add_argument("--out", required=True, help="the .jsonl file to write (and to resume)")
    reg.add_argument("--max-samples", type=int, default=None, help="use the first N conversations")
    reg.add_argument("--max-turns", type=int, default=None,
                     help="keep each conversation's first N exchanges (user turn and reply); default: all")
    reg.add_argument("--max-tokens", type=int, default=512, help="longest regenerated reply")
    reg.add_argument("--max-len", type=int, default=None,
                     help="longest conversation in tokens; later turns are dropped (default: 2048 or the model's limit)")
    reg.add_argument("--chunk-size", type=int, default=256, help="conversations per journaled chunk")
    _reply_sampling_args(reg)
    _engine_args(reg, speculative=False)
    reg.set_defaults(func=cmd_regenerate)
    from eyas.train.command import add_train_parser

    add_train_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"eyas {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
