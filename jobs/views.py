"""Server-rendered pages: experiments, runs, resource groups, submitting a run, the API docs.

Every page but the API docs needs a login; what a user sees is limited to
their teams exactly as in the API (another team's run is a 404). Changes go
through jobs.handler, as in the API.
"""

from __future__ import annotations

from functools import lru_cache

import yaml
from django import forms
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_POST

from jobs import handler
from jobs.models import Experiment, Run
from jobs.states import CANCELLABLE_STATES, IllegalTransition, RunState
from rlplatform import permissions as perms
from rlplatform.api import annotate_group_usage
from rlplatform.models import Host, Role

PAGE_SIZE = 50
SPEC_PLACEHOLDER = """# A run spec (YAML). Every field has a default; see runtime/spec.py.
name: my-run
pipeline:
  mode: sync
  steps: 20
resources:
  device: cpu
  trainer_devices: 1
"""


def _visible_runs(user):
    return Run.objects.filter(experiment__team__in=perms.teams_for(user)).select_related(
        "experiment", "experiment__team", "created_by"
    )


@login_required
def experiments(request: HttpRequest) -> HttpResponse:
    states = {st.value: Count("runs", filter=Q(runs__state=st.value)) for st in RunState}
    rows = (
        Experiment.objects.filter(team__in=perms.teams_for(request.user))
        .select_related("team", "group")
        .annotate(run_count=Count("runs"), **{f"n_{name.lower()}": agg for name, agg in states.items()})
        .order_by("team__name", "name")
    )
    return render(request, "jobs/experiments.html", {"experiments": rows})


@login_required
def experiment(request: HttpRequest, pk: int) -> HttpResponse:
    exp = get_object_or_404(
        Experiment.objects.filter(team__in=perms.teams_for(request.user)).select_related("team", "group", "quota"),
        pk=pk,
    )
    runs = exp.runs.select_related("created_by").order_by("-submitted_at", "-pk")
    state = request.GET.get("state", "").upper()
    if state in RunState.__members__:
        runs = runs.filter(state=state)
    page = Paginator(runs, PAGE_SIZE).get_page(request.GET.get("page"))
    context = {
        "experiment": exp,
        "page": page,
        "state": state,
        "states": [st.value for st in RunState],
        "can_submit": perms.can_edit(request.user, exp.team_id),
    }
    return render(request, "jobs/experiment.html", context)


@login_required
def run_detail(request: HttpRequest, pk: int) -> HttpResponse:
    run = get_object_or_404(_visible_runs(request.user), pk=pk)
    devices = [
        f"{a.device.host.name}:{a.device.index}"
        for a in run.allocations.active().select_related("device__host").order_by("device__host__name", "device__index")
    ]
    context = {
        "run": run,
        "devices": devices,
        "queue": handler.queue_info(run),
        "can_cancel": RunState(run.state) in CANCELLABLE_STATES
        and perms.can_edit(request.user, run.experiment.team_id),
        "resolved_spec": _yaml(run.resolved_spec),
    }
    return render(request, "jobs/run.html", context)


def _yaml(data) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False)


@login_required
@require_POST
def run_cancel(request: HttpRequest, pk: int) -> HttpResponse:
    run = get_object_or_404(_visible_runs(request.user), pk=pk)
    if not perms.can_edit(request.user, run.experiment.team_id):
        return HttpResponse("Viewers cannot cancel runs.", status=403)
    try:
        handler.cancel_run(request.user, run, request.POST.get("reason") or None)
        messages.success(request, f"Run {run.pk} cancelled.")
    except IllegalTransition as exc:
        messages.error(request, str(exc))
    return redirect("jobs:run", pk=run.pk)


@login_required
def groups(request: HttpRequest) -> HttpResponse:
    visible = perms.groups_for(request.user)
    rows = annotate_group_usage(visible).order_by("name")
    hosts = (
        Host.objects.filter(group__in=visible)
        .annotate(
            n_devices=Count("devices", distinct=True),
            n_used=Count("devices", filter=Q(devices__allocations__released_at__isnull=True), distinct=True),
        )
        .order_by("group_id", "name")
    )
    by_group: dict[int, list[Host]] = {}
    for host in hosts:
        by_group.setdefault(host.group_id, []).append(host)
    for group in rows:
        group.host_rows = by_group.get(group.pk, [])
        group.used_pct = round(100 * group.devices_used / group.devices_total) if group.devices_total else 0
    return render(request, "jobs/groups.html", {"groups": rows})


class SubmitForm(forms.Form):
    experiment = forms.ModelChoiceField(queryset=Experiment.objects.none(), empty_label=None)
    submission_id = forms.CharField(
        required=False, help_text="Optional: a resubmit with the same id returns the same run"
    )
    priority = forms.IntegerField(required=False, help_text="Optional: overrides the quota's priority")
    spec = forms.CharField(widget=forms.Textarea(attrs={"spellcheck": "false", "placeholder": SPEC_PLACEHOLDER}))

    def __init__(self, *args, user, **kwargs):
        super().__init__(*args, **kwargs)
        editable = perms.teams_for(user, Role.EDITOR)
        self.fields["experiment"].queryset = (
            Experiment.objects.filter(team__in=editable).select_related("team").order_by("team__name", "name")
        )
        self.fields["experiment"].label_from_instance = lambda e: f"{e.team.name} / {e.name}"


@login_required
def submit(request: HttpRequest) -> HttpResponse:
    """Submit a run from YAML. Spec errors appear under the text area, each with its field path."""
    spec_errors: list[dict[str, str]] = []
    if request.method == "POST":
        form = SubmitForm(request.POST, user=request.user)
        if form.is_valid():
            values = form.cleaned_data
            try:
                run, created = handler.submit_run(
                    request.user,
                    values["experiment"],
                    values["spec"],
                    submission_id=values["submission_id"] or None,
                    priority=values["priority"],
                )
            except handler.InvalidInput as exc:
                for err in exc.errors:
                    if err["field"] in ("submission_id", "priority"):
                        form.add_error(err["field"], err["message"])
                    else:
                        spec_errors.append(err)
            except handler.Conflict as exc:
                form.add_error("submission_id", str(exc))
            else:
                if not created:
                    messages.info(request, f"That submission id was used before: this is run {run.pk}.")
                return redirect("jobs:run", pk=run.pk)
    else:
        initial = {"spec": SPEC_PLACEHOLDER}
        if request.GET.get("experiment", "").isdigit():
            initial["experiment"] = int(request.GET["experiment"])
        form = SubmitForm(initial=initial, user=request.user)
    status = 400 if request.method == "POST" else 200
    return render(request, "jobs/submit.html", {"form": form, "spec_errors": spec_errors}, status=status)


# --- API docs (no CDN: the schema rendered on the server) ---------------------------------------------


@lru_cache(maxsize=1)
def _schema() -> dict:
    from drf_spectacular.generators import SchemaGenerator

    return SchemaGenerator().get_schema(request=None, public=True)


def _ref_name(schema: dict | None) -> str:
    if not schema:
        return ""
    if "$ref" in schema:
        return schema["$ref"].rsplit("/", 1)[-1]
    if schema.get("type") == "array":
        return f"list of {_ref_name(schema.get('items'))}"
    return schema.get("type", "") or "object"


def _endpoints(schema: dict) -> list[dict]:
    rows = []
    for path, ops in schema.get("paths", {}).items():
        for method, op in ops.items():
            if method not in ("get", "post", "put", "patch", "delete"):
                continue
            body = (op.get("requestBody") or {}).get("content", {}).get("application/json", {}).get("schema")
            rows.append(
                {
                    "path": path,
                    "method": method,
                    "summary": op.get("description") or op.get("summary") or "",
                    "tag": (op.get("tags") or [""])[0],
                    "params": [
                        {"name": p["name"], "in": p["in"], "description": p.get("description", "")}
                        for p in op.get("parameters", [])
                    ],
                    "body": _ref_name(body),
                    "responses": [
                        (code, _ref_name((r.get("content") or {}).get("application/json", {}).get("schema")))
                        for code, r in op.get("responses", {}).items()
                    ],
                }
            )
    return rows


def _components(schema: dict) -> list[dict]:
    out = []
    for name, comp in sorted(schema.get("components", {}).get("schemas", {}).items()):
        props = comp.get("properties", {})
        required = set(comp.get("required", []))
        out.append(
            {
                "name": name,
                "fields": [
                    {
                        "name": field,
                        "type": _ref_name(spec) or ("enum" if "enum" in spec else ""),
                        "required": field in required,
                        "read_only": spec.get("readOnly", False),
                        "description": spec.get("description", ""),
                    }
                    for field, spec in props.items()
                ],
            }
        )
    return out


def api_docs(request: HttpRequest) -> HttpResponse:
    schema = _schema()
    context = {"info": schema.get("info", {}), "endpoints": _endpoints(schema), "components": _components(schema)}
    return render(request, "jobs/api_docs.html", context)
