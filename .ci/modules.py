"""Print the suite's time per test module from JUnit XML reports (stdlib only).

``python3 .ci/modules.py build/junit.xml [build/junit-alone.xml ...]``

wall-s is the sum of the module's test times (setup, call and teardown) as
measured in the run: under ``make test``'s parallel workers that is time on a
loaded machine, longer than the module alone would take. cpu-s is the CPU the
tests' processes used (``spark_dilation.testing.cputime``: self plus children),
which load does not stretch; "-" where a report has none. apps, execs and
daemons are the JVMs the module's tests started (the same plugin): Spark
applications (``SparkSubmit``, Spark Connect servers included), other JVMs
(executors), standalone Masters and Workers; the last line sums each column.
"""

import sys
import xml.etree.ElementTree as ET
from collections import Counter


def main(paths: list[str]) -> None:
    wall: Counter[str] = Counter()
    cpu: Counter[str] = Counter()
    measured: set[str] = set()
    tests: Counter[str] = Counter()
    apps: Counter[str] = Counter()
    daemons: Counter[str] = Counter()
    executors: Counter[str] = Counter()
    for path in paths:
        for case in ET.parse(path).iter("testcase"):
            module = case.get("classname", "?").removeprefix("tests.").split(".")[0]
            wall[module] += float(case.get("time") or 0.0)
            tests[module] += 1
            for prop in case.iter("property"):
                if prop.get("name") == "cpu_s":
                    cpu[module] += float(prop.get("value") or 0.0)
                    measured.add(module)
                elif prop.get("name") == "jvms":
                    for entry in (prop.get("value") or "").split():
                        cls, _, n = entry.rpartition(":")
                        if cls == "SparkSubmit":
                            apps[module] += int(n)
                        elif cls in ("Master", "Worker"):
                            daemons[module] += int(n)
                        else:
                            executors[module] += int(n)
    head = f"{'module':32s} {'tests':>5s} {'wall-s':>8s} {'cpu-s':>8s} "
    head += f"{'apps':>5s} {'execs':>5s} {'daemons':>7s}"
    print(f"ci: {head}")
    for module, spent in wall.most_common():
        used = f"{cpu[module]:8.1f}" if module in measured else f"{'-':>8s}"
        print(
            f"ci: {module:32s} {tests[module]:5d} {spent:8.1f} {used} "
            f"{apps[module]:5d} {executors[module]:5d} {daemons[module]:7d}"
        )
    total_cpu = f"{sum(cpu.values()):8.1f}" if measured else f"{'-':>8s}"
    print(
        f"ci: {'total':32s} {sum(tests.values()):5d} {sum(wall.values()):8.1f} {total_cpu} "
        f"{sum(apps.values()):5d} {sum(executors.values()):5d} {sum(daemons.values()):7d}"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
