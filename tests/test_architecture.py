"""The layout by process holds: layers and no cycles (import-linter), every py4j call in one
module, and modules and classes of a size a reader can hold."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "spark_stretch"


def test_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=PACKAGE.parent, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_every_call_into_spark_internals_is_in_driver_jvm():
    jvm_attrs = re.compile(r"\._(jvm|jdf|jsq|jc|jsc|jsparkSession|jreader|jwrite)\b")
    offenders = [f"{p.relative_to(PACKAGE)}:{i}" for p in PACKAGE.rglob("*.py")
                 if p != PACKAGE / "driver" / "jvm.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if jvm_attrs.search(line) or re.match(r"\s*(from|import) py4j", line)]
    assert not offenders, offenders


def test_modules_and_classes_of_the_process_folders_stay_small():
    too_long = []
    for folder in ("api", "driver", "host"):
        for p in (PACKAGE / folder).rglob("*.py"):
            lines = p.read_text().splitlines()
            if len(lines) > 400:
                too_long.append(f"{p.relative_to(PACKAGE)}: {len(lines)} lines")
            for node in ast.walk(ast.parse("\n".join(lines))):
                if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno > 300:
                    too_long.append(f"{p.relative_to(PACKAGE)}:{node.name}: "
                                    f"{node.end_lineno - node.lineno} lines")
    assert not too_long, too_long


def test_each_process_folder_says_where_its_code_runs():
    for folder, where in (("api", "driver process"), ("driver", "driver process"),
                          ("host", "host engine process"), ("worker", "instance processes"),
                          ("protocol", "processes")):
        doc = ast.get_docstring(ast.parse((PACKAGE / folder / "__init__.py").read_text()))
        assert doc and where in doc, folder
