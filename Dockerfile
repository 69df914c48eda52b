# hookpolicy: run a training script under a policy, metrics for Prometheus on port 9400.
#
#   docker build -t hookpolicy .
#   docker run --rm -v "$PWD:/work" -p 9400:9400 hookpolicy \
#       apply /work/policy.yaml --metrics-addr 0.0.0.0 --metrics-port 9400 -- python /work/train.py
#
# The library policies and the bundled examples are in the image too; a first run needs no mount:
#   docker run --rm hookpolicy apply /opt/hookpolicy/policies/example-monitor.yaml -- \
#       python /opt/hookpolicy/examples/train_mlp.py --steps 20
# It runs as the unprivileged user `hookpolicy` (uid 1000); to write logs and tensor files into
# a mounted folder owned by you, add --user "$(id -u):$(id -g)".
# Ops-managed guardrails: mount a folder and name it in HOOKPOLICY_POLICY_DIRS
#   -v /srv/guardrails:/etc/hookpolicy/guardrails:ro -e HOOKPOLICY_POLICY_DIRS=/etc/hookpolicy/guardrails
# See docs/operations.md. Every RUN below is a command CI also runs outside Docker.
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

# CPU PyTorch first, from PyTorch's CPU index: a bare `torch` requirement pulls the CUDA
# build (gigabytes). hookpolicy's own `torch>=2.4,<3` is then already satisfied.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

# Only what .dockerignore lets through: pyproject.toml, README.md, LICENSE, hookpolicy/,
# policies/, examples/.
COPY . /opt/hookpolicy/
RUN pip install /opt/hookpolicy && hookpolicy --version \
    && useradd --create-home --uid 1000 --user-group hookpolicy \
    && mkdir -p /work && chown hookpolicy:hookpolicy /work

# Training scripts and policies are mounted here; files a policy writes (tensor files,
# JSON-lines logs) go to the working directory unless HOOKPOLICY_OUTPUT_DIR says otherwise.
USER hookpolicy
WORKDIR /work
EXPOSE 9400
ENTRYPOINT ["hookpolicy"]
CMD ["--help"]
