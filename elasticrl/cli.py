"""``elasticrl``: the command line. Nothing else imports this module."""
from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from pathlib import Path
from typing import List, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="RL alignment of language models, one job spec from a workstation to a cluster.")


def _fail(message: str, code: int) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def run(
    spec: Path = typer.Argument(..., help="Job spec (YAML). See examples/ and `elasticrl spec`."),
    output: Path = typer.Option(..., "--output", "-o", help="Folder for metrics, checkpoints and the final model."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field: --set train.lr=3e-4 (repeatable)."),
):
    """Run a job on this machine (a private Ray starts and stops with it)."""
    from elasticrl.cluster import RoleError
    from elasticrl.spec import SpecError, load_spec

    try:
        job = load_spec(spec, set_ or [])
    except SpecError as exc:
        _fail(f"{spec}: {exc}" if not str(exc).startswith(str(spec)) else str(exc), 2)
    _quiet_libraries()
    from elasticrl.trainers import run_job

    try:
        summary = run_job(job, output)
    except (SpecError, ValueError, FileNotFoundError) as exc:
        _fail(str(exc), 2)
    except RoleError as exc:
        log = output / "error.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("".join(traceback.format_exception(exc)))
        _fail(f"{str(exc).splitlines()[0]} (full trace: {log})", 1)
    except KeyboardInterrupt:
        _fail("interrupted", 130)
    typer.echo(json.dumps({"output": str(output), **summary}, default=str))


@app.command("spec")
def spec_reference(
    path: Optional[Path] = typer.Argument(None, help="Validate this spec and print it resolved."),
    set_: Optional[List[str]] = typer.Option(None, "--set", help="Override a field (repeatable)."),
):
    """Print every spec field with its default and meaning, or a spec resolved."""
    from elasticrl.spec import SpecError, describe, load_spec, spec_to_dict

    if path is None:
        for field, default, doc in describe():
            typer.echo(f"{field:34} {default:10} {doc}")
        return
    try:
        import yaml

        typer.echo(yaml.safe_dump(spec_to_dict(load_spec(path, set_ or [])), sort_keys=False), nl=False)
    except SpecError as exc:
        _fail(str(exc), 2)


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "1")
    for name in ("DeepSpeed", "deepspeed", "ray", "transformers"):
        logging.getLogger(name).setLevel(logging.WARNING)


def main() -> None:
    app(prog_name="elasticrl")


if __name__ == "__main__":
    sys.exit(main())
