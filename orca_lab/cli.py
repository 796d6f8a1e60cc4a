"""``orca-lab``: the workbench's command line. ``orca-lab compare`` is the main job."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from orca_lab.config import MAX_THREADS, PRESETS, EngineConfig, FieldError, check_out_dir, check_range
from orca_lab.engine.fields import check
from orca_lab.engine.policies import REGISTRY, system
from orca_lab.environment import environment
from orca_lab.serving.watchdog import STALL_S
from orca_lab.workload import SCALE_RANGE


def compare(args) -> dict:
    """Serve one paper-shaped trace with ORCA and with the request-level baseline, same model, at loads
    from light to past the baseline's capacity (or at ``--rate`` only)."""
    from orca_lab.compare import COLUMNS, compare as run_comparison, trace_at
    from orca_lab.llm import LLM
    from orca_lab.viz import export

    import time
    import torch
    t0, cpu0 = time.perf_counter(), time.process_time()
    torch.set_num_threads(args.threads)   # this process is ours; small ops stall with 2+ threads on a busy CPU
    engine = EngineConfig(max_bs=args.max_bs, n_slots=args.n_slots, device=args.device, dtype=args.dtype,
                          tensor_parallel=args.tp, pipeline_parallel=args.pp)
    llm = LLM.from_pretrained(args.checkpoint, engine=engine) if args.checkpoint else \
        LLM(args.model, seed=args.seed, engine=engine)
    longest = max(it.max_tokens for it in trace_at(None, args.n_requests, args.seed, args.scale, llm.cfg.vocab_size))
    if longest > llm.cfg.max_seq_len:
        raise FieldError(f"scale={args.scale:g} makes requests of up to {longest} tokens (prompt + max_gen_tokens), "
                         f"more than {llm.cfg.name}'s max length {llm.cfg.max_seq_len}: use a smaller --scale", "scale")
    print(f"model {llm.cfg.name} on {args.device} ({args.dtype}, tp {args.tp} x pp {args.pp}), "
          f"{args.n_requests} requests (lengths x{args.scale}), max_bs {args.max_bs}, n_slots {args.n_slots}, "
          + (f"at {args.rate} req/s" if args.rate else "loads from a capacity probe"), file=sys.stderr)
    cmp = run_comparison(llm, args.n_requests, args.seed, args.scale, [args.rate] if args.rate else None,
                         args.probe_requests)
    table = cmp.table.assign(rate=cmp.table["rate"].round(2)).set_index(["system", "rate"])
    if cmp.capacity_rps:
        print("capacity (offline probe), its requests all there at once: "
              + ", ".join(f"{s} {c:.2f} req/s" for s, c in cmp.capacity_rps.items())
              + "; load = rate / the baseline's offline capacity")
    print(table[COLUMNS].to_string(float_format=lambda v: f"{v:,.2f}"))
    kept = cmp.kept_up_rps()
    print("under Poisson arrivals, kept up (served >= 90% of the offered rate) up to: " + ", ".join(
        f"{s} {r:.2f} req/s" if r else f"{s} none of the rates tried" for s, r in kept.items()))
    print("\n" + cmp.verdict())
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"args": vars(args), "environment": environment(), "capacity_rps": cmp.capacity_rps,
              "capacity_probe": "offline: the first --probe-requests requests all there at t=0"
              if cmp.capacity_rps else "none: --rate given",
              "kept_up_rps": kept,
              "summary": cmp.table.to_dict("records"),
              "runs": [{"rate": rate, **r.to_json()} for (_, rate), r in cmp.runs.items()]}
    report.update(wall_s=time.perf_counter() - t0, cpu_s=time.process_time() - cpu0)   # model, probe, runs
    print(f"{report['wall_s']:.0f} s wall, {report['cpu_s']:.1f} s of CPU in this process")
    (out / "compare.json").write_text(json.dumps(report, indent=1, default=str))
    export(cmp.figure(), out / "compare.html")
    print(f"wrote {out / 'compare.json'} and {out / 'compare.html'}")
    return report


def serve(args):
    """``orca-lab serve``: the OpenAI-compatible endpoint (orca_lab.serving.server)."""
    from orca_lab.serving.engine_core import EngineArgs
    from orca_lab.serving.server import EngineDied, serve as run
    check_range("max_queue", args.max_queue, 1, 1 << 20)
    check_range("drain_s", args.drain_s, 0.0, 3600.0, kind=float)
    check_range("threads", args.threads, 1, MAX_THREADS)
    check("seed", args.seed)
    engine = EngineConfig(max_bs=args.max_bs, n_slots=args.n_slots, tensor_parallel=args.tp,
                          pipeline_parallel=args.pp, device=args.device, dtype=args.dtype,
                          block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                          prefix_caching=args.prefix_caching, schedule_policy=args.schedule_policy)
    system(args.system).check(engine.prefix_caching, engine.schedule_policy)
    template = None
    if args.chat_template is not None:
        from orca_lab.serving.chat import check_template
        try:
            template = check_template(Path(args.chat_template).read_text(), args.chat_template)
        except OSError as e:
            raise ValueError(f"--chat-template {args.chat_template}: cannot read it ({e.strerror})") from None
    model = args.checkpoint or args.model or "tiny"
    if args.plugins == "":           # --plugins alone: the package the notebooks wrote, from any folder
        from orca_lab.course.mine import home
        args.plugins = str(home())
    recipe = EngineArgs(model, args.seed, engine, args.system, args.threads, args.plugins, args.tensor_ranks,
                        args.stall_s)
    try:
        run(recipe, args.host, args.port, args.max_queue, args.drain_s, model_name=model, debug=args.debug,
            chat_template=template, ssl_certfile=args.ssl_certfile, ssl_keyfile=args.ssl_keyfile)
    except EngineDied as e:       # exit 1, for a supervisor to restart the server
        raise SystemExit(f"orca-lab serve: the engine died ({e}); exiting with code 1") from None


def bench(args) -> dict:
    """``orca-lab bench``: the load generator (orca_lab.serving.bench)."""
    from orca_lab.serving.bench import run
    return run(args)


def course(args):
    """``orca-lab course build``: the course site (orca_lab.course.site)."""
    from orca_lab.course.site import build
    for flag in ("executed", "notebooks"):
        if getattr(args, flag) is not None and not Path(getattr(args, flag)).is_dir():
            raise FieldError(f"--{flag} {getattr(args, flag)}: no such folder", flag)
    if args.out is not None:
        check_out_dir("--out", args.out)
    build(args.out and Path(args.out), executed=args.executed and Path(args.executed),
          notebooks=args.notebooks and Path(args.notebooks), only=args.only, record=args.record,
          edition=args.edition)


def _course_args(s):
    b = s.add_subparsers(dest="action", required=True).add_parser(
        "build", help="execute the notebooks and build the site with Sphinx, offline (html/index.html)")
    b.add_argument("--edition", default="learner",
                   help="learner: the exercises as stubs, no solution on any page (build/course); "
                        "instructor: the solved notebooks (build/course-instructor)")
    b.add_argument("--out", default=None, help="build folder; the site is in OUT/html (default: build/course, "
                                               "build/course-instructor for the instructor edition)")
    b.add_argument("--executed", default=None, help="a folder of executed notebooks (notebooks/, reproduce/ "
                                                    "inside): build from them, execute nothing")
    b.add_argument("--notebooks", default=None, help="execute the course notebooks of this folder instead "
                                                     "of the solved ones (OUT/solved, made from notebooks/ "
                                                     "and notebooks/solutions/)")
    b.add_argument("--only", nargs="+", default=None, help="only these chapters, each named by its number "
                                                           "(11), first word (fig9) or whole name (kv_memory)")
    b.add_argument("--record", action="store_true",
                   help="write the measured run times to docs/results/course_runtimes.json")


def main(argv=None):
    p = argparse.ArgumentParser(prog="orca-lab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compare", help="ORCA vs the request-level baseline on one trace, light load to past "
                                       "the baseline's capacity")
    c.add_argument("--model", default="tiny", choices=list(PRESETS))
    c.add_argument("--checkpoint", default=None, help="a local GPT-2, Llama or Qwen2 directory (Hugging Face layout) "
                                                      "instead of --model's random weights")
    c.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    c.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    c.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (worker processes)")
    c.add_argument("--pp", type=int, default=1, help="pipeline-parallel degree (the paper's n_workers)")
    c.add_argument("--n-requests", type=int, default=32, help="requests served at each load")
    c.add_argument("--rate", type=float, default=None,
                   help="one Poisson arrival rate, req/s (default: loads set from a capacity probe)")
    c.add_argument("--probe-requests", type=int, default=16,
                   help="requests of the capacity probe, served all at once (offline capacity)")
    c.add_argument("--scale", type=float, default=0.25, help="multiplies the paper's lengths")
    c.add_argument("--max-bs", type=int, default=16)
    c.add_argument("--n-slots", type=int, default=16384)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--threads", type=int, default=1, help="torch intra-op threads (recorded)")
    c.add_argument("--out", default="results")
    _serve_args(sub.add_parser("serve", help="an OpenAI-compatible server over the engine (completions, chat, "
                                             "tokenize)"))
    from orca_lab.serving.bench import add_arguments
    add_arguments(sub.add_parser("bench", help="load generator for any OpenAI-compatible completions endpoint"))
    _course_args(sub.add_parser("course", help="the course site: orca-lab course build"))
    args = p.parse_args(argv)
    try:
        _check_checkpoint(args)
        _check_compare(args)
        {"compare": compare, "serve": serve, "bench": bench, "course": course}[args.cmd](args)
    except ValueError as e:       # bad input: a clear message, no traceback
        p.exit(2, f"orca-lab: error: {e}\n")


def _check_checkpoint(args):
    """``--checkpoint DIR`` (compare, serve), or serve's ``--model`` naming a directory, must be a
    checkpoint directory of a supported family: refused here, naming the flag, before a model or a
    server is started."""
    flag, path = "--checkpoint", getattr(args, "checkpoint", None)
    if args.cmd == "serve" and path is not None and args.model is not None:
        raise ValueError(f"--model {args.model} and --checkpoint {args.checkpoint}: give one of them")
    if args.cmd == "serve" and path is None and args.model is not None and Path(args.model).is_dir():
        flag, path = "--model", args.model
    if path is None:
        return
    from orca_lab.model.checkpoint import SafetensorFiles
    from orca_lab.model.families import checkpoint_config
    try:
        checkpoint_config(path)
        SafetensorFiles(path).check()
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path}: {e}") from None
    except KeyError as e:
        raise ValueError(f"{flag} {path}: config.json has no field {e}") from None


MAX_ARRIVALS_S = 3600.0     # how long compare's Poisson arrivals may take, at --rate


def _check_compare(args):
    """Bad numbers stop here, each named with its range, and ``--out`` is made (or refused), before a
    model is built."""
    if args.cmd != "compare":
        return
    check_range("n_requests", args.n_requests, 2, 100_000)
    check_range("threads", args.threads, 1, MAX_THREADS)
    check("seed", args.seed)
    check_out_dir("out", args.out)
    check_range("probe_requests", args.probe_requests, 2, 100_000)
    check_range("tp", args.tp, 1, 1024)
    check_range("pp", args.pp, 1, 1024)
    check_range("scale", args.scale, *SCALE_RANGE, kind=float)
    if args.rate is not None:
        check_range("rate", args.rate, 0.0, 1e9, kind=float, open_lo=True)
        if args.n_requests / args.rate > MAX_ARRIVALS_S:       # the engine waits for each in real time
            raise FieldError(f"rate={args.rate:g} req/s: {args.n_requests} requests would arrive over about "
                             f"{args.n_requests / args.rate:,.0f} s; allowed >= {args.n_requests / MAX_ARRIVALS_S:.3g} "
                             f"req/s ({MAX_ARRIVALS_S:.0f} s of arrivals)", "rate")


def _serve_args(s):
    from orca_lab.serving.engine_core import HISTORY
    s.add_argument("--model", default=None, help=f"a preset ({', '.join(PRESETS)}; default tiny), random weights "
                                                  "of --seed; or a checkpoint directory, as --checkpoint")
    s.add_argument("--checkpoint", metavar="DIR", default=None,
                   help="a local GPT-2, Llama or Qwen2 directory (Hugging Face layout: config.json, safetensors "
                        "one file or sharded, tokenizer.json); read from disk, never downloaded")
    s.add_argument("--seed", type=int, default=0, help="random weights of a preset: those of LLM(model, seed)")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0: the OS chooses (printed at start)")
    s.add_argument("--ssl-certfile", metavar="FILE", default=None, help="serve HTTPS with this certificate (PEM)")
    s.add_argument("--ssl-keyfile", metavar="FILE", default=None,
                   help="its private key (PEM). A key the server asks for ($ORCA_LAB_API_KEY: every route but "
                        "/health and /metrics takes Authorization: Bearer <key>) crosses the network only over HTTPS")
    paged = ", ".join(n for n, entry in REGISTRY.items() if entry.paged)
    s.add_argument("--system", default="orca", choices=list(REGISTRY),
                   help="the scheduling policy (orca_lab/engine/policies.py's registry)")
    s.add_argument("--max-bs", type=int, default=32)
    s.add_argument("--n-slots", type=int, default=16384)
    s.add_argument("--block-size", type=int, default=16, help=f"{paged}: K/V slots per block")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, help="chunked: new tokens per iteration")
    s.add_argument("--prefix-caching", action="store_true", help=f"{paged}: cache and share full K/V blocks")
    s.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"],
                   help=f"{paged} with --prefix-caching: lpm = longest cached prefix first")
    s.add_argument("--tp", type=int, default=1, help="tensor-parallel workers")
    s.add_argument("--pp", type=int, default=1, help="pipeline-parallel workers (the paper's n_workers)")
    s.add_argument("--max-queue", type=int, default=1024, help="waiting requests before 503")
    s.add_argument("--drain-s", type=float, default=5.0, help="on SIGINT/SIGTERM, time left to requests in flight")
    s.add_argument("--device", default="cpu")
    s.add_argument("--dtype", default="float32")
    s.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    s.add_argument("--chat-template", metavar="FILE", default=None,
                   help="a Jinja chat template for /v1/chat/completions (default: the tokenizer's own, if any)")
    s.add_argument("--stall-s", type=float, default=STALL_S,
                   help="an iteration that has not returned after this many seconds is a stuck engine: "
                        "/health and /v1/models answer 503 and the log names where it is stuck; with --plugins, "
                        "a call into a learner's piece longer than this stops the engine, naming it")
    s.add_argument("--debug", action="store_true",
                   help=f"serve GET /debug/run: the records of the last {HISTORY:,} requests and iterations "
                        "(engine) and completions (HTTP); without it the server keeps none")
    s.add_argument("--plugins", metavar="FOLDER_OR_MODULE", nargs="?", const="", default=None,
                   help="a course learner's package (my_orca/, written by the notebooks' %%%%exercise cells; "
                        "alone: the one they wrote, notebooks/my_orca or $ORCA_LAB_MY_ORCA): the engine runs its "
                        "pieces (Select, slot manager, ...) in place of the package's, driven by their loop if any")
    s.add_argument("--tensor-ranks", type=int, default=1,
                   help="with --plugins: the model on this many tensor-parallel ranks (threads of the engine "
                        "process) cut by the learner's split_linear and added by their all_reduce (notebook 07)")


if __name__ == "__main__":
    main()
