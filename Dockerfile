# One image for every kiln service (api, worker, celery, migrate); docker-compose.yml picks the
# command. GPU builds: --build-arg TORCH_SPEC=torch==<version> with PIP_EXTRA_INDEX_URL pointing
# at a CUDA wheel index.
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ARG PIP_EXTRA_INDEX_URL=""
ENV PIP_NO_CACHE_DIR=1 PIP_EXTRA_INDEX_URL=${PIP_EXTRA_INDEX_URL} PYTHONUNBUFFERED=1

WORKDIR /app
# torch first and alone: it is the big layer and changes least often.
RUN pip install "${TORCH_SPEC}"
COPY pyproject.toml README.md alembic.ini ./
COPY common ./common
COPY kiln ./kiln
COPY api ./api
COPY scheduler ./scheduler
COPY runtime ./runtime
COPY storage ./storage
COPY migrations ./migrations
RUN pip install ".[postgres,s3]"

ENV KILN_OUTPUT_DIR=/data/outputs KILN_DATA_DIR=/data
RUN useradd --create-home kiln && mkdir -p /data/outputs /data/models && chown -R kiln /data
USER kiln
EXPOSE 8000
CMD ["kiln", "api", "--host", "0.0.0.0"]
