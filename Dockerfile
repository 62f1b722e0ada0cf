# One image for every butler; docker-compose.yml runs `butlers run NAME` once per butler.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

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
ENTRYPOINT ["butlers"]
CMD ["up"]
