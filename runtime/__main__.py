"""The runtime's command line.

    python -m runtime run SPEC.yaml [key.sub=value ...] [--resume DIR]
    python -m runtime sft SPEC.yaml [key.sub=value ...] --steps N --out DIR
    python -m runtime make-model DIR --from-task NAME [task.sub=value ...] [--vocab-size N ...]   (a local BPE model)
    python -m runtime eval --checkpoint DIR [--spec SPEC.yaml] [key.sub=value ...]
    python -m runtime validate SPEC.yaml [key.sub=value ...]
    python -m runtime rollout SPEC.yaml --index I [--endpoint FILE] [key.sub=value ...]   (a remote rollout instance)
    python -m runtime evaluator SPEC.yaml [--endpoint FILE] [key.sub=value ...]   (a remote evaluator)
    python -m runtime trainer-ranks SPEC.yaml --ranks FIRST-LAST [key.sub=value ...]   (trainer ranks on another host)
    python -m runtime role trainer --spec FILE --workdir DIR [--resume auto|never]   (platform-managed runs)
    python -m runtime role rollout --spec FILE --workdir DIR                         (its remote rollout instances)
    python -m runtime role evaluator|trainer-ranks --spec FILE --workdir DIR         (its remote evaluator, ranks)

Bad input — an unknown or invalid field, an impossible combination, a
missing model path or dataset, a malformed dataset row, a broken tokenizer
file, a device that is not there, vllm not installed for rollout.engine vllm,
a corrupt or partial checkpoint — is
reported as one line naming the field (or file and row), with exit status 2. A failure during the run exits 1
with a one-line reason. ``role`` also takes its settings from ``TANDEM_*``
environment variables (runtime.managed.entry, docs/runtime-role.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from runtime.contract import EXIT_BAD_INPUT, EXIT_FAILED
from runtime.spec import RunSpec, SpecError, load_spec


class UsageError(Exception):
    """Bad input found before any work started."""


def _input_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean bad input (imported lazily: ``validate`` needs no torch)."""
    from runtime.checkpoint import CheckpointError
    from runtime.devices import DeviceError
    from runtime.managed.entry import RoleInputError
    from runtime.models import ModelError
    from runtime.rollout.vllm_adapter import VLLMUnavailable
    from runtime.tasks import TaskError
    from runtime.train.algos import AlgorithmError
    from runtime.train.trainer import TrainerError
    from runtime.workloads.gym.errors import EnvSpecError, LearnerError, SamplerError

    # Every error class the runtime raises for what it was given (spec, dataset rows, model directory,
    # tokenizer, checkpoint, device): the platform fails the run once on exit 2 and blames no host.
    return (
        UsageError,
        SpecError,
        AlgorithmError,
        CheckpointError,
        DeviceError,
        ModelError,
        RoleInputError,
        TaskError,
        TrainerError,
        VLLMUnavailable,
        EnvSpecError,
        LearnerError,
        SamplerError,
    )


def _check_vllm_can_serve(spec: RunSpec) -> None:
    """vLLM built for this device, the model's head size one it serves, its KV cache in host memory (cpu)."""
    from runtime.rollout.vllm_adapter import VLLMUnavailable
    from runtime.vllm_support import cpu_head_sizes, head_dim_problem, host_memory_problem, platform_problem
    from runtime.workloads.llm.models import vllm_kv_cache_bytes

    problem = platform_problem(spec.resources.device)
    if problem is not None:
        raise VLLMUnavailable(f"rollout.engine: {problem}")
    sizes = cpu_head_sizes()
    if spec.model.path and (problem := head_dim_problem(spec.model.path, spec.resources.device, sizes)):
        raise UsageError(f"model.path: {problem}")
    kv_bytes = vllm_kv_cache_bytes(spec)
    if spec.resources.device == "cpu" and kv_bytes and (problem := host_memory_problem(kv_bytes)):
        raise UsageError(f"rollout.kv_cache_gib: {problem}")


def _check_lora(spec: RunSpec, algorithm: Any) -> None:
    """LoRA with an algorithm that updates every weight itself, and targets the model does not have."""
    from runtime.models.lora import check_targets
    from runtime.workloads.llm.probe import _skeleton

    if algorithm.needs_full_weights:
        raise UsageError(
            f"model.lora: algorithm {spec.algorithm.name} needs full weights (Algorithm.needs_full_weights); "
            "train it without model.lora"
        )
    check_targets(_skeleton(spec.model, spec.resources.device), spec.model.lora)  # the meta-device tree


def preflight(spec: RunSpec, resume: str | None = None) -> Path | None:
    """Check everything that can be checked cheaply before any work starts; returns the resume checkpoint."""
    from runtime.devices import resolve_device
    from runtime.models import check_model_path
    from runtime.placement import trainer_devices_here
    from runtime.rollout.vllm_adapter import import_vllm
    from runtime.train.algos import get_algorithm

    if spec.rollout.engine == "vllm":  # the package first: a host without it can never run this spec
        import_vllm()
        _check_vllm_can_serve(spec)
    resolve_device(spec.resources.device, 0)
    if spec.workload == "gym":  # the env builds and its action space suits the learner (EnvSpecError otherwise)
        from runtime.workloads.gym.build import describe_env

        describe_env(spec)
        return None if resume is None else _checkpoint(resume)
    if spec.resources.device != "cpu":  # this host's devices: its trainer ranks, rollout devices, evaluator
        n = trainer_devices_here(spec) + spec.resources.rollout_devices + spec.resources.eval_devices
        resolve_device(spec.resources.device, n - 1)
    if spec.model.path:
        check_model_path(spec.model.path)
    algorithm = get_algorithm(spec.algorithm.name)
    if spec.model.lora is not None:
        _check_lora(spec, algorithm)
    for field in ("path", "eval_path"):
        value = getattr(spec.task, field)
        if value and not Path(value).is_file():
            raise UsageError(f"task.{field}: no such file: {value}")
    if spec.task.name == "dataset":  # every row read and checked, and the chat template found (TaskError)
        from runtime.tasks import build_task

        build_task(spec.task, spec.model.path)
    if spec.samples_per_step > spec.queue_capacity:
        raise UsageError(
            f"pipeline.queue_capacity: {spec.queue_capacity} cannot hold one step's {spec.samples_per_step} samples"
        )
    if resume is None:
        return None
    return _checkpoint(resume)


def _checkpoint(where: str) -> Path:
    """The verified checkpoint at (or newest under) ``where``."""
    from runtime.checkpoint import verify_checkpoint
    from runtime.pipeline.driver import PipelineError, resolve_resume

    try:
        path = resolve_resume(where)
    except PipelineError as exc:
        raise UsageError(str(exc)) from None
    verify_checkpoint(path)
    return path


def _cmd_validate(args: argparse.Namespace) -> int:
    spec = load_spec(args.spec, args.overrides)
    sys.stdout.write(yaml.safe_dump(spec.resolved(), sort_keys=False))
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from runtime import processes

    spec = load_spec(args.spec, args.overrides)
    resume = preflight(spec, args.resume)
    processes.fork_server_here(spec)  # now, with one thread and no device opened: children share our imports

    from runtime.pipeline import run

    result = run(spec, resume=resume)
    summary = {k: result[k] for k in ("mode", "steps", "output_dir", "checkpoint")}
    summary["final"] = result["metrics"]
    summary["eval"] = result["eval"]
    print(json.dumps(summary, default=str))
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from runtime.train.sft import run_sft

    spec = load_spec(args.spec, args.overrides)
    preflight(spec)
    if args.steps < 1:
        raise UsageError("--steps: must be >= 1")
    out = run_sft(spec, args.steps, Path(args.out))
    print(json.dumps({"model_dir": str(out)}))
    return 0


# make-model's size presets: the default tiny one, and the smallest vLLM's CPU build serves (head_dim 64;
# vLLM's CPU attention refuses 16), which tests/vllm/ and the vLLM benchmarks use.
MODEL_PRESETS: dict[str, dict[str, int]] = {
    "tiny": {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2},
    "vllm-cpu": {"hidden_size": 128, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1},
}


def _cmd_make_model(args: argparse.Namespace) -> int:
    """A small Qwen2 model directory whose BPE tokenizer is trained on a task's prompts and answers."""
    from runtime.models.local_hf import CHAT_TEMPLATE, SUMMARY_FILE, build_local_model_dir, task_corpus
    from runtime.tasks import build_task

    others = [o for o in args.overrides if not o.startswith("task.")]
    if others:
        raise UsageError(f"make-model: only task.* overrides choose the corpus, got {' '.join(others)}")
    spec = load_spec({"task": {"name": args.from_task}}, args.overrides)
    corpus = task_corpus(build_task(spec.task))
    sizes = dict(MODEL_PRESETS[args.preset])
    given = {"hidden_size": args.hidden_size, "num_layers": args.layers, "num_heads": args.heads}
    given["num_kv_heads"] = args.kv_heads
    sizes.update({k: v for k, v in given.items() if v is not None})
    try:
        out = build_local_model_dir(
            args.directory,
            corpus=corpus,
            vocab_size=args.vocab_size,
            chat_template=None if args.no_chat_template else CHAT_TEMPLATE,
            hidden_size=sizes["hidden_size"],
            num_layers=sizes["num_layers"],
            num_heads=sizes["num_heads"],
            num_kv_heads=sizes["num_kv_heads"],
            seed=args.seed,
        )
    except ValueError as exc:  # it names the keyword argument; the user gave the flag
        argument, _, why = str(exc).partition(": ")
        flags = {"vocab_size": "--vocab-size", "hidden_size": "--hidden-size", "num_layers": "--layers"}
        flags.update(num_heads="--heads", num_kv_heads="--kv-heads", directory="DIRECTORY", corpus="--from-task")
        raise UsageError(f"{flags.get(argument, argument)}: {why}") from None
    print(json.dumps({"model_dir": str(out), **json.loads((out / SUMMARY_FILE).read_text())}))
    return 0


def _eval_spec(args: argparse.Namespace) -> tuple[RunSpec, Path]:
    from runtime.checkpoint import CheckpointError

    ckpt = _checkpoint(args.checkpoint)
    policy_dir = ckpt / "policy"
    if not (policy_dir / "config.json").is_file():
        raise CheckpointError(f"{ckpt}: holds no HF policy directory (policy/config.json)")
    spec_file = Path(args.spec) if args.spec else ckpt.parent.parent / "resolved_spec.yaml"
    if not spec_file.is_file():
        raise UsageError(f"--spec: no spec given and none found at {spec_file}")
    spec = load_spec(spec_file, [*args.overrides, f"model.path={policy_dir}"])
    return spec, ckpt


def _cmd_eval(args: argparse.Namespace) -> int:
    from runtime.devices import resolve_device, set_threads
    from runtime.evaluation.evaluator import evaluate
    from runtime.workloads.llm import build_engine, build_task

    spec, ckpt = _eval_spec(args)
    preflight(spec)
    set_threads(spec.resources.threads_per_process)
    device = resolve_device(spec.resources.device, 0)
    engine = build_engine(None, None, device, spec)  # the checkpoint's policy/ directory is model.path
    task = build_task(spec)
    r = spec.rollout
    metrics = evaluate(engine, engine.tokenizer, task, task.eval_prompts(), r.max_new_tokens, r.max_batch_size)
    print(json.dumps({"checkpoint": str(ckpt), **metrics}))
    return 0


def _serve_the_trainer(args: argparse.Namespace, make: Callable[[Any, Callable[[str], None]], Any]) -> int:
    """A process of its own that serves an async run's trainer over the link until the run ends:
    ``make(spec, log)`` builds it (a remote rollout instance, the remote evaluator)."""
    from runtime.devices import resolve_device
    from runtime.models import check_model_path
    from runtime.rollout.link import env_key
    from runtime.rollout.remote import RolloutRefused, endpoint_path

    spec = load_spec(args.spec, args.overrides)
    resolve_device(spec.resources.device, 0)
    if spec.model.path:
        check_model_path(spec.model.path)
    try:
        server = make(spec, lambda m: print(m, file=sys.stderr, flush=True))
        return server.serve(endpoint_path(spec, args.endpoint), env_key())
    except RolloutRefused as exc:
        raise UsageError(str(exc)) from None


def _cmd_rollout(args: argparse.Namespace) -> int:
    from runtime.rollout.remote import RemoteInstance

    return _serve_the_trainer(args, lambda spec, log: RemoteInstance(spec, args.index, log=log))


def _cmd_evaluator(args: argparse.Namespace) -> int:
    from runtime.evaluation.remote import EvaluatorProcess, require_remote

    def make(spec: Any, log: Callable[[str], None]) -> EvaluatorProcess:
        require_remote(spec)
        return EvaluatorProcess(spec, log=log)

    return _serve_the_trainer(args, make)


def _cmd_trainer_ranks(args: argparse.Namespace) -> int:
    from runtime.devices import resolve_device
    from runtime.pipeline.driver import thread_plan
    from runtime.placement import TrainerGroupError, parse_ranks
    from runtime.train.group import serve_ranks

    spec = load_spec(args.spec, args.overrides)
    try:
        ranks = parse_ranks(args.ranks, spec.resources.trainer_devices, "--ranks")
    except TrainerGroupError as exc:
        raise UsageError(str(exc)) from None
    resolve_device(spec.resources.device, len(ranks) - 1)
    threads = thread_plan(spec)[0]
    try:
        return serve_ranks(spec, ranks, threads)
    except TrainerGroupError as exc:
        raise UsageError(str(exc)) from None


def _cmd_role(args: argparse.Namespace) -> int:
    from runtime import processes
    from runtime.devices import resolve_device
    from runtime.managed import entry as role

    options = role.parse_args(args.rest)
    env = role.read_env(os.environ)
    spec = role.load_role_spec(options.spec, options.workdir)
    if options.role in ("rollout", "evaluator"):
        resolve_device(spec.resources.device, 0)  # its one device; the model is checked as it loads
        run_beside = role.run_rollout if options.role == "rollout" else role.run_evaluator
        return run_beside(spec, env, options.workdir)
    if options.role == "trainer-ranks":
        ranks = role.trainer_ranks(spec, os.environ)
        processes.fork_server_here(spec)  # before a device is opened or a thread started (runtime.processes)
        resolve_device(spec.resources.device, len(ranks) - 1)  # one device per rank, in rank order
        return role.run_trainer_ranks(spec, env, ranks)
    preflight(spec)
    processes.fork_server_here(spec)
    resume = role.find_resume(options.workdir) if options.resume == "auto" else None
    summary = role.run_trainer(spec, env, options.workdir, resume)
    print(json.dumps(summary))  # the last stdout line: what the platform's launcher reads
    return 0


def _trainer_server_parser(sub: Any, name: str, what: str, func: Callable[[argparse.Namespace], int]) -> Any:
    """The arguments every process that serves a trainer over the link takes (see _serve_the_trainer)."""
    p = sub.add_parser(name, help=f"{what} of an async run (connects to its trainer)")
    p.add_argument("spec")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides (the trainer's spec must match)")
    p.add_argument(
        "--endpoint", metavar="FILE", help="the trainer's endpoint file (default: OUTPUT_DIR/rollout-endpoint.json)"
    )
    p.set_defaults(func=func)
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m runtime", description="Tandem RL runtime")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("run", help="run a spec")
    p.add_argument("spec")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides")
    p.add_argument("--resume", metavar="DIR", help="checkpoint (or run / checkpoints directory) to continue from")
    p.set_defaults(func=_cmd_run)

    p = sub.add_parser("sft", help="supervised warm start; writes an HF model directory")
    p.add_argument("spec")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("make-model", help="build a small Qwen2 directory with a BPE tokenizer trained on a task")
    p.add_argument("directory", help="where to write it (new or empty)")
    p.add_argument("overrides", nargs="*", help="task.sub=value overrides of the corpus task")
    p.add_argument("--from-task", required=True, metavar="NAME", help="task whose prompts and answers train the BPE")
    p.add_argument("--vocab-size", type=int, default=512, help="BPE tokens, specials included (default 512)")
    p.add_argument(
        "--preset",
        choices=sorted(MODEL_PRESETS),
        default="tiny",
        help="sizes (tiny: hidden 64, 4 heads of 16; vllm-cpu: hidden 128, 2 heads of 64, the smallest shape "
        "vLLM's CPU attention serves); the size flags below override it",
    )
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--seed", type=int, default=0, help="seed of the model's initial weights")
    p.add_argument("--no-chat-template", action="store_true", help="leave the tokenizer without a chat template")
    p.set_defaults(func=_cmd_make_model)

    p = sub.add_parser("eval", help="greedy held-out evaluation of a checkpoint")
    p.add_argument("--checkpoint", required=True, metavar="DIR")
    p.add_argument("--spec", help="spec to take the task from (default: the run's resolved_spec.yaml)")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_eval)

    p = _trainer_server_parser(sub, "rollout", "a remote rollout instance", _cmd_rollout)
    p.add_argument("--index", type=int, required=True, help="which remote instance: 0 .. remote_rollout_workers-1")
    _trainer_server_parser(sub, "evaluator", "the remote evaluator", _cmd_evaluator)

    p = sub.add_parser("trainer-ranks", help="data-parallel trainer ranks of a leader on another host")
    p.add_argument("spec")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides (the leader's spec must match)")
    p.add_argument("--ranks", required=True, help="the ranks this host runs, FIRST-LAST (1 or more)")
    p.set_defaults(func=_cmd_trainer_ranks)

    p = sub.add_parser("validate", help="print the resolved spec, or the field errors")
    p.add_argument("spec")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser(
        "role", add_help=False, help="run one role of a platform-managed run (settings from TANDEM_* variables)"
    )
    # Parsed by runtime.managed.entry, so that bad arguments are one line naming the argument (exit 2).
    p.add_argument("rest", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_role)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["role"]:
        # runtime.managed.entry parses the rest itself: argparse's REMAINDER cannot take a leading option
        # (`role --spec F trainer`), and a bad argument must be one line naming it, not a usage block.
        return _guarded(lambda: _cmd_role(argparse.Namespace(rest=argv[1:])), _input_errors())
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # `run spec --resume DIR a=b`: argparse leaves overrides that follow an option unparsed
    unknown = [x for x in extra if x.startswith("-") or "=" not in x]
    if unknown or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if args.command == "validate":
        errors: tuple[type[BaseException], ...] = (SpecError, UsageError)
    else:
        errors = _input_errors()
    return _guarded(lambda: args.func(args), errors)


def _guarded(command: Callable[[], int], errors: tuple[type[BaseException], ...]) -> int:
    """Run ``command``; bad input -> one line, exit 2; a failure mid-run -> one line, exit 1."""
    try:
        return command()
    except errors as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a failure mid-run: one readable line, no traceback
        print(f"error: {type(exc).__name__}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_FAILED


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
