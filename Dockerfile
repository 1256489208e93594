# One image for the control plane (web, beat) and CPU host agents.
# Ascend hosts build FROM a CANN base image and add requirements-npu.txt.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app

COPY requirements.txt .
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install -r requirements.txt

COPY . .
RUN DJANGO_SETTINGS_MODULE=rlplatform.settings SECRET_KEY=build python manage.py collectstatic --noinput

EXPOSE 8000
CMD ["uvicorn", "rlplatform.asgi:application", "--host", "0.0.0.0", "--port", "8000"]
