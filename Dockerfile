# spark-dilation with Spark (pip's pyspark), the wormhole servers and JupyterLab.
# Used by docker-compose.yml for every service.
FROM python:3.11-slim

RUN apt-get update \
 && apt-get install -y --no-install-recommends openjdk-17-jre-headless procps \
 && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYSPARK_PYTHON=/opt/venv/bin/python
RUN python -m venv /opt/venv && pip install --no-cache-dir --upgrade pip

# The project from this repository, with Spark, the servers and the Spark Connect client;
# JupyterLab pinned as in pyproject.toml's [test] extra (tests/test_compose.py runs it).
WORKDIR /src
COPY pyproject.toml README.md pyspark_dilation.py ./
COPY spark_dilation ./spark_dilation
RUN pip install --no-cache-dir '.[spark,server,connect]' jupyterlab==4.6.6 \
 && python -m compileall -q /opt/venv/lib/python3.11/site-packages/spark_dilation

WORKDIR /work
COPY notebooks ./notebooks
EXPOSE 4000 4001 7077 8080 8081 8888
