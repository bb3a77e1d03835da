"""Print the suite's time per test module from a JUnit XML report (stdlib only).

Seconds are the sum of the module's test times (setup, call and teardown) as
measured in the run: under ``make test``'s parallel workers that is time on a
loaded machine, longer than the module alone would take.
"""

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def main(path: str) -> None:
    seconds: Counter[str] = Counter()
    tests: Counter[str] = Counter()
    for case in ET.parse(path).iter("testcase"):
        module = case.get("classname", "?").removeprefix("tests.").split(".")[0]
        seconds[module] += float(case.get("time") or 0.0)
        tests[module] += 1
    print(f"ci: {'module':32s} {'tests':>5s} {'seconds':>8s}")
    for module, spent in seconds.most_common():
        print(f"ci: {module:32s} {tests[module]:5d} {spent:8.1f}")
    print(f"ci: {'total':32s} {sum(tests.values()):5d} {sum(seconds.values()):8.1f}")


if __name__ == "__main__":
    main(sys.argv[1])
