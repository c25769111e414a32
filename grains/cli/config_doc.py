"""The configuration table, generated from the settings model (README keeps a copy).

    python -m grains.cli.config_doc            # print the markdown table
    python -m grains.cli.config_doc --write README.md   # refresh the README's copy
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from silo.settings import SiloSettings

START = "<!-- config-table:start -->"
END = "<!-- config-table:end -->"


def _default(field: FieldInfo) -> str:
    value: Any = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is None:
        return "unset"
    if isinstance(value, dict):
        return json.dumps(value) if value else "(none)"
    if isinstance(value, tuple):
        return ",".join(map(str, value)) or "(none)"
    if isinstance(value, float) and value.is_integer() and value >= 1024:
        return str(int(value))
    return json.dumps(value) if isinstance(value, str) else str(value)


def rows(model: type[BaseModel] = SiloSettings, prefix: str = "REDGRAIN_") -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.extend(rows(ann, f"{prefix}{name.upper()}__"))
            continue
        out.append((prefix + name.upper(), _default(field), (field.description or "").replace("|", "\\|")))
    return out


def settings_table() -> str:
    lines = ["| environment variable | default | meaning |", "|---|---|---|"]
    lines += [f"| `{env}` | `{default}` | {desc} |" for env, default, desc in rows()]
    return "\n".join(lines)


def refresh(path: Path) -> bool:
    """Rewrite the table between the markers; True when it changed."""
    text = path.read_text()
    pattern = re.compile(re.escape(START) + ".*?" + re.escape(END), re.DOTALL)
    new = pattern.sub(START + "\n" + settings_table() + "\n" + END, text)
    if new != text:
        path.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="refresh the table inside this markdown file")
    args = parser.parse_args(argv)
    if args.write:
        print("updated" if refresh(args.write) else "already current")
    else:
        print(settings_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
