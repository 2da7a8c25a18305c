# One image for every llmgw process; compose.yaml picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY llmgw ./llmgw
COPY projections ./projections
COPY cli ./cli
RUN pip install . && useradd --create-home --uid 10001 llmgw && mkdir -p /data && chown llmgw /data
COPY examples /opt/llmgw/examples

USER llmgw
WORKDIR /data
ENTRYPOINT ["llmgw"]
CMD ["--help"]
