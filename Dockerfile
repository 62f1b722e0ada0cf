# One image for every butler; docker-compose.yml runs `butlers run NAME` once per butler.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 butler
WORKDIR /app

# Dependencies first, so editing the code does not reinstall them.
COPY pyproject.toml README.md ./
COPY butlers/__init__.py butlers/__init__.py
RUN pip install .  && pip uninstall --yes butlers

COPY butlers butlers
COPY migrations migrations
COPY config config
# Editable: the alembic migrations are read from /app/migrations, next to the package.
RUN pip install --no-deps -e . && mkdir -p /app/.butlers && chown butler /app/.butlers

USER 10001
EXPOSE 8100 8101 8102 8103
ENTRYPOINT ["butlers"]
CMD ["up"]
