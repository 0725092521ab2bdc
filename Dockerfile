# The ckpt-tiering image used by docker-compose.yml (agent, catalog migrations).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY ckpt ckpt
COPY db db
COPY flows flows
COPY tasks tasks
COPY deployments deployments
RUN pip install --no-cache-dir .
ENTRYPOINT []
CMD ["ckpt", "agent"]
