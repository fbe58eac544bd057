#!/bin/sh
# Entry point of the MLflow container. The backend store and the artifact destination come from
# MLFLOW_BACKEND_STORE_URI and MLFLOW_ARTIFACTS_DESTINATION (environment, not argv, so the
# database password never shows in `ps`).
set -eu
# docker compose passes unset optional settings as empty strings; MLflow would hand an empty S3
# endpoint URL to boto3, so empty ones are unset.
for var in MLFLOW_S3_ENDPOINT_URL AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY; do
    eval "[ -n \"\${$var:-}\" ]" || unset "$var"
done
# 0.0.0.0 inside the container only; the host side of the port mapping decides who can connect.
exec mlflow server --host 0.0.0.0 --port 5000 --serve-artifacts "$@"
