# One image for every butler; docker-compose.yml runs `butlers run NAME` once per butler.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# tini as PID 1: a butler spawns Claude Code, which spawns processes of its own, and a process
# whose parent dies is handed to PID 1. Python as PID 1 never reaps those (zombies pile up) and
# ignores a SIGTERM it set no handler for yet; tini reaps every orphan and passes signals on.
# `-s` (subreaper) keeps that working under another init too (compose's `init: true`).
RUN apt-get update \
    && apt-get install --yes --no-install-recommends tini \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 butler
WORKDIR /app

# Dependencies first, so editing the code does not reinstall them: the versions the tests ran
# with (requirements.lock as constraints: only what butlers needs, not the test tools).
COPY requirements.lock pyproject.toml README.md LICENSE ./
COPY butlers/__init__.py butlers/__init__.py
RUN pip install -c requirements.lock . && pip uninstall --yes butlers

# A regular install: the alembic migrations are package data (butlers/migrations).
COPY butlers butlers
COPY config config
RUN pip install --no-deps . && mkdir -p /app/.butlers && chown butler /app/.butlers

USER 10001
EXPOSE 8100 8101 8102 8103
# Liveness: GET /livez (answered by the process itself, never the database: /health is
# readiness) on each butler port this container listens on, with the standard library (no
# curl in the image). A refused port is one this container does not serve (`butlers run
# NAME` serves one of them, `up` all four); healthy when at least one answered 200 and none
# answered otherwise or hung.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["python", "-c", "import sys, urllib.request\ndef live(port):\n    try:\n        with urllib.request.urlopen(f'http://127.0.0.1:{port}/livez', timeout=2) as answer:\n            return answer.status == 200\n    except OSError as error:\n        if isinstance(getattr(error, 'reason', error), ConnectionRefusedError):\n            return None\n        return False\nfound = [live(port) for port in sys.argv[1:]]\nsys.exit(0 if True in found and False not in found else 1)\n", "8100", "8101", "8102", "8103"]
ENTRYPOINT ["tini", "-s", "--", "butlers"]
CMD ["up"]
