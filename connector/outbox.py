"""What the scheduler half's two sides emit between hooks: commands for the control thread, counter bumps.

The prefill side and the decode side (`scheduler_prefill.py`, `scheduler_decode.py`) share one `Outbox`,
so a `both` engine has one command queue and one set of counters; the scheduler half drains it at every
hook. Counter names are `counters.COUNTERS`; `version` changes with every bump, so the facade publishes
the counters only when they changed.
"""

from __future__ import annotations

from pdgate.connector.counters import COUNTERS
from pdgate.connector.messages import Command

__all__ = ["Outbox"]


class Outbox:
    def __init__(self) -> None:
        self.commands: list[Command] = []
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.version = 0

    def send(self, command: Command) -> None:
        self.commands.append(command)

    def bump(self, name: str, by: int = 1) -> None:
        if by:
            self.counters[name] += by
            self.version += 1

    def take_commands(self) -> list[Command]:
        out, self.commands = self.commands, []
        return out
