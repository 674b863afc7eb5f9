"""Write tests/module_seconds.json from pytest JUnit XML reports: each test module's seconds.

    .venv/bin/pytest ... --junitxml=run.xml
    .venv/bin/python scripts/test-durations.py run.xml [more.xml ...]

`make test` hands the parallel workers whole modules (`--dist loadfile`), longest first
(tests/conftest.py reads this file), so that no long module starts last and runs alone
while the other workers idle. The figures only order the modules: a stale one costs some
seconds of wall time, never a test; a module missing from the file gets its directory's
median.
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "tests" / "module_seconds.json"


def module_of(classname: str) -> str:
    """'tests.system.test_ddp' or 'tests.system.test_ddp.TestX' -> 'system/test_ddp.py'."""
    parts = classname.split(".")
    while parts and parts[-1][:1].isupper():
        parts.pop()
    if parts and parts[0] == "tests":
        parts = parts[1:]
    return "/".join(parts) + ".py"


def main(reports: list[str]) -> int:
    if not reports:
        print(__doc__, file=sys.stderr)
        return 2
    seconds: Counter[str] = Counter()
    for report in reports:
        for case in ET.parse(report).getroot().iter("testcase"):
            seconds[module_of(case.get("classname", ""))] += float(case.get("time") or 0)
    old = json.loads(OUT.read_text()) if OUT.is_file() else {}
    old.update({m: round(s, 1) for m, s in seconds.items()})
    OUT.write_text(json.dumps(dict(sorted(old.items())), indent=0) + "\n")
    print(f"{OUT}: {len(seconds)} modules from {len(reports)} report(s), {len(old)} in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
