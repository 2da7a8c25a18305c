# One image for every llmgw process; compose.yaml picks the command.
#
# BASE chooses what else the image holds. The default is a slim Python: the control
# plane (projector, planner, scheduler, router) needs nothing more. An agent must also
# run the engines it is asked to place, so its image is built on an engine's image:
#
#   docker build -t llmgw .                                                   # control plane
#   docker build -t llmgw-agent --build-arg BASE=vllm/vllm-openai:v0.33.0 .   # agent + vLLM
#
# llmgw lives in its own virtual environment (/opt/llmgw), so the base's packages (vLLM
# pins its own aiohttp, msgspec, prometheus-client…) are neither upgraded nor pinned by
# ours, and the base's `vllm` stays on PATH for the agent. Versions come from
# constraints.txt: an image built later gets what the tests ran with.
ARG BASE=python:3.11-slim
FROM ${BASE}

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY llmgw ./llmgw
COPY projections ./projections
COPY cli ./cli
# --without-pip and the base's own pip: engine images often lack ensurepip.
RUN python3 -m venv --without-pip /opt/llmgw \
    && python3 -m pip --python /opt/llmgw/bin/python install -c constraints.txt . \
    && (id -u llmgw >/dev/null 2>&1 || useradd --create-home --uid 10001 llmgw) \
    && mkdir -p /data/hf && chown -R llmgw /data
COPY examples /opt/llmgw/examples

ENV PATH=/opt/llmgw/bin:$PATH
USER llmgw
WORKDIR /data
ENTRYPOINT ["llmgw"]
CMD ["--help"]
