"""The JSON record of a measurement: when, the command, the machine, then its figures."""

import datetime
import json
from pathlib import Path
from typing import Any

from .machine import machine


def head(command: list[str]) -> dict[str, Any]:
    return {
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "machine": machine(),
    }


def write_json(record: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
