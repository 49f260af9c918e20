"""Files a scenario names for its load (``load.trace``, a class's ``dataset``): paths are taken
relative to the scenario file, and each file is read once at validation, so a bad row is a
scenario error (``scenario.yaml:7:10: load.trace.file: trace.jsonl:3: ...``) before anything
starts, not a load process dying mid-run."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from streamquake.errors import ScenarioError
from streamquake.jsontypes import JsonValue
from streamquake.located_yaml import Pos, YamlDoc


@dataclass(frozen=True)
class DataFile:
    field: str          # load.trace.file, load.classes.0.dataset
    kind: str           # "trace" or "dataset"
    path: Path
    line: int
    col: int
    source: str | None


def resolve(doc: YamlDoc, filename: str) -> list[DataFile]:
    """Make the paths in ``doc`` absolute (relative to the scenario's folder); list them."""
    base = Path(filename).parent if filename and not filename.startswith("<") else Path.cwd()
    load, load_pos = _child(doc.value, doc.pos, "load")
    found: list[DataFile] = []
    if not isinstance(load, dict):
        return found
    trace, trace_pos = _child(load, load_pos, "trace")
    if isinstance(trace, str):
        load["trace"] = path = _abs(base, trace)
        found.append(_ref("load.trace", "trace", path, trace_pos))
    elif isinstance(trace, dict) and isinstance(trace_file := trace.get("file"), str):
        _, file_pos = _child(trace, trace_pos, "file")
        trace["file"] = path = _abs(base, trace_file)
        found.append(_ref("load.trace.file", "trace", path, file_pos))
    classes, classes_pos = _child(load, load_pos, "classes")
    if isinstance(classes, list):
        for i, cls in enumerate(classes):
            if isinstance(cls, dict) and isinstance(dataset := cls.get("dataset"), str):
                cls_pos = (classes_pos.items[i] if classes_pos and classes_pos.items
                           and i < len(classes_pos.items) else None)
                _, ds_pos = _child(cls, cls_pos, "dataset")
                cls["dataset"] = path = _abs(base, dataset)
                found.append(_ref(f"load.classes.{i}.dataset", "dataset", path, ds_pos))
    return found


def check(files: list[DataFile], filename: str, speedup: float = 1.0,
          classes: tuple[str, ...] = ()) -> None:
    from streamquake.loadgen.trace import read_prompts, read_trace

    problems: list[str] = []
    for f in files:
        where = f"{filename} ({f.source})" if f.source else f"{filename}:{f.line}:{f.col}"
        try:
            if f.kind == "trace":
                rows = read_trace(f.path, speedup)
                unknown = sorted({r.cls for r in rows if r.cls and r.cls not in classes})
                if unknown:
                    problems.append(
                        f"{where}: {f.field}: rows name classes that load.classes does not "
                        f"have: {', '.join(unknown)} (have: {', '.join(classes)}); add them, "
                        "or remove 'class' from the rows")
            else:
                read_prompts(f.path)
        except ScenarioError as exc:
            problems += [f"{where}: {f.field}: {p}" for p in exc.problems]
    if problems:
        raise ScenarioError(problems)


def _child(value: JsonValue, pos: Pos | None, key: str) -> tuple[JsonValue, Pos | None]:
    if not isinstance(value, dict) or key not in value:
        return None, None
    child_pos = pos.keys.get(key) if pos is not None and pos.keys else None
    return value[key], child_pos[2] if child_pos else None


def _abs(base: Path, text: str) -> str:
    """``text`` as an absolute path; unchanged when no file system could name it (a NUL in
    it), so that reading it reports the file as unreadable where the scenario names it."""
    try:
        p = Path(text).expanduser()
        return str(p if p.is_absolute() else (base / p).resolve())
    except (ValueError, OSError):
        return text


def _ref(field: str, kind: str, path: str, pos: Pos | None) -> DataFile:
    return DataFile(field, kind, Path(path), pos.line if pos else 1, pos.col if pos else 1,
                    pos.source if pos else None)
