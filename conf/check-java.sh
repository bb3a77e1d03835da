#!/bin/sh
# Spark needs Java 17 or newer: the one system prerequisite.
if ! command -v java >/dev/null 2>&1; then
    echo "Java 17+ is required (for Spark) and was not found." >&2
    echo "Install it, e.g. 'sudo apt-get install openjdk-17-jre-headless' (Debian/Ubuntu)," >&2
    echo "'brew install openjdk@17' (macOS), then run make again." >&2
    exit 1
fi
major=$(java -version 2>&1 | sed -n 's/.*version "\([0-9]*\).*/\1/p' | head -1)
if [ -z "$major" ] || [ "$major" -lt 17 ]; then
    echo "Java 17+ is required (for Spark); found: $(java -version 2>&1 | head -1)." >&2
    echo "Install a newer JDK, e.g. 'sudo apt-get install openjdk-17-jre-headless'." >&2
    exit 1
fi
