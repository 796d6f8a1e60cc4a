"""Which installed versions (``pip freeze`` on stdin) differ from a lock file's pins: what moved."""
import re
import sys


def pins(lines) -> dict[str, str]:
    out = {}
    for line in lines:
        if m := re.match(r"^([A-Za-z0-9_.-]+)==([^\s;]+)", line):
            out[re.sub(r"[-_.]+", "-", m[1]).lower()] = m[2].split("+")[0]   # 2.13.0+cpu is 2.13.0
    return out


locked, installed = pins(open(sys.argv[1])), pins(sys.stdin)
moved = sorted((n, v, locked.get(n, "(not locked)")) for n, v in installed.items() if locked.get(n) != v)
for name, new, old in moved:
    print(f"  {name}: {new}  (lock: {old})")
print(f"  {len(moved)} of {len(installed)} packages differ")
