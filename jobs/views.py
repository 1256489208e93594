"""Server-rendered pages: experiments, runs, the cluster, checkpoints, quotas, submitting a run, the API docs.

The live parts (charts, controls, state changes) are ES modules in frontend/js/
fed by the REST API and the per-run WebSocket stream; these views render the
first paint and embed what the scripts need as JSON.

Every page but the API docs needs a login; what a user sees is limited to
their teams exactly as in the API (another team's run is a 404). Changes go
through jobs.handler, as in the API.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from django import forms
from django.conf import settings
from django.contrib import messages
from django.contrib.auth.decorators import login_required
from django.core.paginator import Paginator
from django.db.models import Count, JSONField, OuterRef, Q, Subquery
from django.http import HttpRequest, HttpResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.utils import timezone
from django.views.decorators.http import require_POST

from jobs import commands, device_usage, handler, queue_order, start_estimate, stream
from jobs.alerts import evaluate as alerts
from jobs.alerts import rules as alert_rules
from jobs.api_docs import api_docs_page
from jobs.config_history import config_history
from jobs.device_charts import device_groups
from jobs.models import (
    CheckpointRecord,
    Command,
    Experiment,
    MetricPoint,
    Run,
    RunEvent,
    RunStreamCounter,
)
from jobs.quota_usage import usage_by_quota
from jobs.states import CANCELLABLE_STATES, IllegalTransition, RunState
from rlplatform import permissions as perms
from rlplatform.api import annotate_group_usage
from rlplatform.models import Host, Quota, Role
from runtime import contract as m

PAGE_SIZE = 50
# Devices with an unreleased allocation. The pk test matters: through the LEFT JOIN, a device
# with no allocation at all also has released_at NULL.
_HOLDING = Q(devices__allocations__pk__isnull=False, devices__allocations__released_at__isnull=True)
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
    runs = exp.runs.select_related("created_by", "experiment").order_by("-submitted_at", "-pk")
    state = request.GET.get("state", "").upper()
    if state in RunState.__members__:
        runs = runs.filter(state=state)
    page = Paginator(runs, PAGE_SIZE).get_page(request.GET.get("page"))
    page.object_list = queue_order.annotate_positions(page.object_list)
    _attach_key_metrics(page.object_list)
    firing = _firing_alerts(Run.objects.filter(experiment=exp))
    can_edit = perms.can_edit(request.user, exp.team_id)
    for run in page.object_list:  # the row's marker; it and the banner are kept live (frontend/js/runs_live.js)
        run.alert_firing = any(a["run"] == run.pk for a in firing)
    context = {
        "experiment": exp,
        "page": page,
        "state": state,
        "states": [st.value for st in RunState],
        "can_submit": can_edit,
        "alerts": firing,
        # The runs' default alert webhook, shown to editors only as the run page shows a run's (experiment_alerts.js)
        "alert_webhook": alert_rules.experiment_webhook_url(exp.pk) if can_edit else "",
    }
    return render(request, "jobs/experiment.html", context)


def _firing_alerts(runs) -> list[dict]:
    """The runs list's alert banner: each firing rule of these runs (jobs.alerts), one query."""
    ids = list(runs.filter(alert_rules__firing=True, alert_rules__enabled=True).values_list("pk", "name").distinct())
    firing = alerts.firing([pk for pk, _name in ids])
    return [{"run": pk, "name": name, "rules": firing.get(pk, [])} for pk, name in sorted(ids) if firing.get(pk)]


# The run page's chart groups: (group, [(chart title, [metric names])]); names are runtime.metrics'.
COMMUNICATION_GROUP = ("Communication", [("Weight sync (s)", [m.TIME_WEIGHT_SYNC])])
LLM_CHART_GROUPS = [
    (
        "Reward & accuracy",
        [
            ("Reward", [m.REWARD_MEAN, m.REWARD_STD]),
            ("Accuracy", [m.ACCURACY, m.EVAL_ACCURACY]),
            ("Response length", [m.RESPONSE_LEN_MEAN, m.RESPONSE_LEN_MAX]),
        ],
    ),
    (
        "Losses",
        [
            ("Policy / value loss", [m.LOSS_POLICY, m.LOSS_VALUE]),
            ("KL", [m.LOSS_KL, m.KL_REF]),
            ("Entropy", [m.ENTROPY]),
            ("Clip fraction", [m.CLIP_FRACTION]),
            ("Grad norm", [m.GRAD_NORM]),
            ("Learning rate", [m.LR]),
        ],
    ),
    (
        "Pipeline",
        [
            ("Staleness", [m.STALENESS_MEAN, m.STALENESS_MAX]),
            ("Sample queue", [m.QUEUE_DEPTH, m.QUEUE_WATERMARK]),
            ("Dropped samples", [m.SAMPLES_DROPPED_STALE, m.SAMPLES_DROPPED_REWARD]),
            ("Bubbles", [m.BUBBLE_TRAINER, m.PADDING_RATIO, m.ROLLOUT_PADDING]),
            ("Rollout balance", [m.ROLLOUT_SKEWNESS, m.ROLLOUT_SORTING_WAIT]),
            ("Rollout instances", [m.ROLLOUT_ACTIVE]),
            ("Weights version", [m.WEIGHTS_VERSION]),
        ],
    ),
    (
        "Throughput & time split",
        [
            ("Tokens / s", [m.GEN_TOKENS_PER_S, m.TRAIN_TOKENS_PER_S]),
            ("Samples / s", [m.SAMPLES_PER_S]),
            ("Time split (s)", [m.TIME_GENERATE, m.TIME_TRAIN, m.TIME_WEIGHT_SYNC, m.TIME_WAIT]),
        ],
    ),
    COMMUNICATION_GROUP,  # + the per-rank gradient charts of a run with trainer ranks (communication_group)
    (
        "Consistency",
        [
            ("Engine vs trainer log-prob gap", [m.CONSISTENCY_DIFF_MEAN, m.CONSISTENCY_DIFF_MAX]),
            ("Engine-trainer KL", [m.CONSISTENCY_KL]),
        ],
    ),
]

# A gym run's (runtime/workloads/gym): episodes and the control learners' own metrics instead of tokens.
GYM_CHART_GROUPS = [
    (
        "Returns",
        [
            ("Episode return", [m.EPISODE_RETURN_MEAN, m.EPISODE_RETURN_MIN, m.EPISODE_RETURN_MAX]),
            ("Evaluation return", [m.EVAL_RETURN_MEAN, m.EVAL_RETURN_MIN, m.EVAL_RETURN_MAX]),
            ("Evaluated weight version", [m.EVAL_WEIGHTS_VERSION]),
            ("Episode length", [m.EPISODE_LENGTH_MEAN]),
        ],
    ),
    (
        "Learner",
        [
            ("Policy / value loss", [m.LOSS_POLICY, m.LOSS_VALUE]),
            ("Entropy", [m.ENTROPY]),
            ("Approx. KL / clip fraction", [m.APPROX_KL, m.CLIP_FRACTION]),
            ("TD loss / error", [m.LOSS_TD, m.TD_ERROR]),
            ("Q values", [m.Q_MEAN]),
            ("Exploration", [m.EPSILON]),
            ("Target syncs", [m.TARGET_SYNCS]),
            ("Target-sync events (per step)", [m.TARGET_SYNC_EVENTS]),
            ("Target-sync wait (s)", [m.TARGET_SYNC_WAIT]),
            ("Replay buffer", [m.REPLAY_SIZE]),
            ("Grad norm", [m.GRAD_NORM]),
            ("Learning rate", [m.LR]),
        ],
    ),
    (
        "Pipeline",
        [
            ("Policy lag (staleness)", [m.STALENESS_MEAN, m.STALENESS_MAX]),
            ("Segment queue", [m.QUEUE_DEPTH, m.QUEUE_WATERMARK]),
            ("Dropped segments", [m.SAMPLES_DROPPED_STALE]),
            ("Sampling workers", [m.ROLLOUT_ACTIVE]),
            ("Weights version", [m.WEIGHTS_VERSION]),
        ],
    ),
    (
        "Throughput & time split",
        [
            ("Env steps / s", [m.ENV_STEPS_PER_S]),
            ("Env steps trained on", [m.ENV_STEPS]),
            ("Segments / s", [m.SAMPLES_PER_S]),
            ("Time split (s)", [m.TIME_GENERATE, m.TIME_TRAIN, m.TIME_WEIGHT_SYNC, m.TIME_WAIT]),
            ("Bubbles", [m.BUBBLE_TRAINER]),
        ],
    ),
]
CHART_GROUPS_BY_WORKLOAD = {"llm": LLM_CHART_GROUPS, "gym": GYM_CHART_GROUPS}

# The checkpoints page's headline columns: (label, [metric names]); a cell shows the first name the
# checkpoint recorded (a gym run's DQN has loss/td, its PPO loss/policy), or a dash. The other
# metrics of a checkpoint are folded away in its row.
CHECKPOINT_HEADLINES_BY_WORKLOAD = {
    "llm": [
        ("Reward", [m.REWARD_MEAN]),
        ("Held-out accuracy", [m.EVAL_ACCURACY]),
        ("Loss", [m.LOSS_POLICY]),
    ],
    "gym": [
        ("Return", [m.EPISODE_RETURN_MEAN]),
        ("Eval return", [m.EVAL_RETURN_MEAN]),
        ("Loss", [m.LOSS_POLICY, m.LOSS_TD]),
    ],
}


def _workload(run: Run) -> str:
    return (run.resolved_spec or {}).get("workload", "llm")  # a resolved spec without the field is an LLM run's


def _trainer_ranks(run: Run) -> int:
    ranks = ((run.resolved_spec or {}).get("resources") or {}).get("trainer_devices", 1)
    return ranks if isinstance(ranks, int) and not isinstance(ranks, bool) else 1


def communication_group(run: Run) -> tuple[str, list]:
    """The Communication group: weight sync, and with two or more trainer ranks each rank's gradient
    communication (runtime.contract.COMM_METRICS), a series per rank, the ranks from the run's spec."""
    title, charts = COMMUNICATION_GROUP
    ranks = range(min(_trainer_ranks(run), m.COMM_MAX_RANKS))
    if len(ranks) < 2:
        return title, charts
    return title, [
        *charts,
        ("Gradient communication per rank (s)", [m.comm_metric(r, m.COMM_GRAD) for r in ranks]),
        ("Gradient wait per rank (s)", [m.comm_metric(r, m.COMM_GRAD_WAIT) for r in ranks]),
    ]


def chart_groups(run: Run) -> list:
    """The run page's chart groups for the run's workload."""
    groups = CHART_GROUPS_BY_WORKLOAD[_workload(run)]
    return [communication_group(run) if group is COMMUNICATION_GROUP else group for group in groups]


def _checkpoint_row(c: CheckpointRecord) -> dict:
    return {"id": c.pk, "step": c.step, "weight_version": c.weight_version, "size": c.size, "metrics": c.metrics}


def _command_row(c: Command) -> dict:
    return {"id": c.pk, "kind": c.kind, "state": c.state, "message": c.message}


def _stream_seq(run: Run) -> int:
    return RunStreamCounter.objects.filter(run=run).values_list("last_seq", flat=True).first() or 0


def _config_rows(run: Run) -> list[dict]:
    """The run page's config table: each live change (jobs.config_history), newest first."""
    return [
        {
            "number": entry["number"],
            "changes": [{"param": key, **change} for key, change in sorted(entry["diff"].items())],
            "created": entry["created_at"],
        }
        for entry in reversed(config_history(run)[1:])  # entry 0 is the submitted spec
    ]


# The runs table's "key metrics" (jobs.stream.KEY_METRICS): from each run's newest live point (one
# subquery per page of runs); kept live by the runs-list socket.


def _attach_key_metrics(runs) -> None:
    ids = [r.pk for r in runs]
    newest = MetricPoint.objects.live().filter(run=OuterRef("pk")).order_by("-step", "-pk").values("metrics")[:1]
    latest = dict(
        Run.objects.filter(pk__in=ids)
        .annotate(last=Subquery(newest, output_field=JSONField()))
        .values_list("pk", "last")
    )
    for run in runs:
        values = latest.get(run.pk) or {}
        run.key_metrics = [(key, values[key]) for key in stream.KEY_METRICS if isinstance(values.get(key), int | float)]


@login_required
def run_detail(request: HttpRequest, pk: int) -> HttpResponse:
    run = get_object_or_404(_visible_runs(request.user), pk=pk)
    devices = [
        f"{a.device.host.name}:{a.device.index}"
        for a in run.allocations.active().select_related("device__host").order_by("device__host__name", "device__index")
    ]
    can_edit = perms.can_edit(request.user, run.experiment.team_id)
    checkpoints = list(run.checkpoints.order_by("-step", "-pk")[:200])
    groups = [*chart_groups(run), *device_groups(run)]  # the run's telemetry charted per device
    live = {
        "run": run.pk,
        "state": run.state,
        "can_edit": can_edit,
        # Which controls each state allows (jobs.commands.ALLOWED_FROM); the server re-checks every one.
        "allowed": {str(kind): sorted(st.value for st in states) for kind, states in commands.ALLOWED_FROM.items()},
        "groups": [{"title": g, "charts": [{"title": t, "keys": k} for t, k in charts]} for g, charts in groups],
        "checkpoints": [_checkpoint_row(c) for c in checkpoints],
        # As the stream's event entries carry them (JSON, not a Python repr): run_page.js draws both alike.
        "events": [
            {"kind": e.kind, "payload": e.payload, "role": e.role, "time": e.time.timestamp()}
            for e in RunEvent.objects.filter(run=run).order_by("-time", "-pk")[:50]
        ],
        "params": commands.effective_params(run),
        "start": (run.started_at or run.submitted_at).timestamp(),
        # The page shows everything up to here (tables rendered now, charts fetched after): the stream resumes after it.
        "stream_seq": _stream_seq(run),
        # The alert rules with their state, and the webhook (jobs.alerts; frontend/js/alerts.js).
        "alerts": [alert_rules.rule_body(r) for r in run.alert_rules.order_by("pk")],
        # its own URL, opt-out, the experiment's default, the effective one (jobs.alerts.rules.webhook_body)
        "alert_webhook": alert_rules.webhook_body(run) if can_edit else None,
    }
    context = {
        "run": run,
        "devices": devices,
        "queue": handler.queue_info(run),
        # computed on read for a queued run only (jobs.start_estimate: a few queries and cached simulations)
        "start_estimate": start_estimate.estimate(run, timezone.now()) if run.state == RunState.QUEUED else None,
        "can_cancel": RunState(run.state) in CANCELLABLE_STATES and can_edit,
        "can_edit": can_edit,
        "resolved_spec": _yaml(run.resolved_spec),
        "live": live,
        "chart_groups": groups,
        "roles": run.heartbeats.order_by("role", "-attempt"),
        "commands": Command.objects.filter(run=run).order_by("-pk")[:20],
        "configs": _config_rows(run),
        "checkpoints": checkpoints,
        "safe_params": commands.live_params(run),
        "alerts": [{"run": run.pk, "name": run.name, "rules": alerts.firing([run.pk]).get(run.pk, [])}],
    }
    return render(request, "jobs/run.html", context)


@login_required
def run_checkpoints(request: HttpRequest, pk: int) -> HttpResponse:
    """The checkpoint browser of one run: rows come from GET /api/runs/<id>/checkpoints/ (frontend/js)."""
    run = get_object_or_404(_visible_runs(request.user), pk=pk)
    headlines = [{"label": label, "keys": keys} for label, keys in CHECKPOINT_HEADLINES_BY_WORKLOAD[_workload(run)]]
    context = {
        "run": run,
        "can_edit": perms.can_edit(request.user, run.experiment.team_id),
        "stream_seq": _stream_seq(run),
        "headlines": headlines,
    }
    return render(request, "jobs/checkpoints.html", context)


@login_required
def compare(request: HttpRequest, pk: int) -> HttpResponse:
    """Overlay a metric of chosen runs of one experiment (``?runs=1,2&key=reward/mean``)."""
    exp = get_object_or_404(Experiment.objects.filter(team__in=perms.teams_for(request.user)), pk=pk)
    runs = list(exp.runs.order_by("-submitted_at", "-pk")[:200])
    chosen = [int(x) for x in request.GET.get("runs", "").split(",") if x.strip().isdigit()]
    chosen = [r.pk for r in runs if r.pk in chosen] or [r.pk for r in runs[:3]]
    key = request.GET.get("key") or m.REWARD_MEAN
    context = {
        "experiment": exp,
        "runs": runs,
        "chosen": chosen,
        "key": key,
        "metric_names": sorted(m.METRICS),
        "live": {
            "runs": [{"id": r.pk, "name": r.name, "seq": _stream_seq(r)} for r in runs if r.pk in chosen],
            "key": key,
        },
    }
    return render(request, "jobs/compare.html", context)


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
            n_used=Count("devices", filter=_HOLDING, distinct=True),
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


@login_required
def cluster(request: HttpRequest) -> HttpResponse:
    """Devices per group and host (used / free / unhealthy), the queue with positions and reasons, budgets."""
    visible = perms.groups_for(request.user)
    groups_ = list(annotate_group_usage(visible).order_by("name"))
    hosts = (
        Host.objects.filter(group__in=visible)
        .annotate(
            n_devices=Count("devices", distinct=True),
            n_used=Count("devices", filter=_HOLDING, distinct=True),
            n_unhealthy=Count("devices", filter=Q(devices__healthy=False), distinct=True),
        )
        .order_by("group_id", "name")
    )
    by_group: dict[int, list[Host]] = {}
    device_rows = device_usage.rows_by_host(hosts, _visible_runs(request.user))
    for host in hosts:
        host.n_free = max(host.n_devices - host.n_used - host.n_unhealthy, 0)
        host.device_rows = device_rows.get(host.pk, [])  # utilisation, memory, holder (the agent's heartbeat)
        by_group.setdefault(host.group_id, []).append(host)
    queued = queue_order.annotate_positions(
        _visible_runs(request.user).filter(state=RunState.QUEUED).select_related("experiment__group")
    )
    queued.sort(key=lambda r: (r.experiment.group.name, r.queue_position or 0, r.pk))
    quotas = Quota.objects.filter(team__in=perms.teams_for(request.user)).select_related("team", "group")
    for group in groups_:
        group.host_rows = by_group.get(group.pk, [])
        group.used_pct = round(100 * group.devices_used / group.devices_total) if group.devices_total else 0
        group.queue = [r for r in queued if r.experiment.group_id == group.pk]
    quotas = list(quotas.order_by("team__name", "group__name", "name"))
    usage = usage_by_quota(quotas, timezone.now())
    budgets = [
        {
            "quota": q,
            "used": usage[q.pk].device_hours,
            "pct": min(round(100 * usage[q.pk].device_hours / q.device_hour_budget), 100)
            if q.device_hour_budget
            else None,
        }
        for q in quotas
    ]
    return render(request, "jobs/cluster.html", {"groups": groups_, "budgets": budgets})


QUOTA_FIELDS = ("max_devices", "max_concurrent_runs", "max_rollout_workers", "priority", "device_hour_budget")


class QuotaForm(forms.Form):
    """One quota's limits; values are checked again by jobs.handler.update_quota (its errors land at the field)."""

    max_devices = forms.IntegerField(min_value=0)
    max_concurrent_runs = forms.IntegerField(min_value=0)
    max_rollout_workers = forms.IntegerField(min_value=0)
    priority = forms.IntegerField()
    device_hour_budget = forms.FloatField(required=False, min_value=0, help_text="Empty = unlimited")


@login_required
def quotas(request: HttpRequest) -> HttpResponse:
    """Platform staff set each quota's limits; every change is audited (jobs.handler.update_quota)."""
    if not perms.can_manage_groups(request.user):
        return HttpResponse("Only platform staff can change quotas.", status=403)
    rows = list(Quota.objects.select_related("team", "group").order_by("team__name", "group__name", "name"))
    status = 200
    bound: dict[int, QuotaForm] = {}
    if request.method == "POST":
        raw = request.POST.get("quota", "")
        quota = get_object_or_404(Quota, pk=int(raw) if raw.isdigit() else 0)
        form = QuotaForm(request.POST, prefix=f"q{quota.pk}")
        if form.is_valid():
            try:
                handler.update_quota(request.user, quota, **form.cleaned_data)
            except handler.InvalidInput as exc:
                for err in exc.errors:
                    form.add_error(err["field"] if err["field"] in QUOTA_FIELDS else None, err["message"])
            else:
                messages.success(request, f"Quota {quota.team.name} / {quota.name} saved.")
                return redirect("jobs:quotas")
        bound[quota.pk] = form
        status = 400
    usage = usage_by_quota(rows, timezone.now(), count_queued=True)
    for q in rows:
        q.form = bound.get(q.pk) or QuotaForm(initial={f: getattr(q, f) for f in QUOTA_FIELDS}, prefix=f"q{q.pk}")
        q.usage = usage[q.pk]
    return render(request, "jobs/quotas.html", {"quotas": rows}, status=status)


def _examples() -> dict[str, str]:
    """The example specs under examples/ by file name (the submit page's seeds)."""
    folder = Path(settings.BASE_DIR) / "examples"
    return {p.name: p.read_text() for p in sorted(folder.glob("*.yaml"))} if folder.is_dir() else {}


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
    context = {"form": form, "spec_errors": spec_errors, "examples": _examples()}
    return render(request, "jobs/submit.html", context, status=status)


# --- API docs (no CDN: the schema rendered on the server, by jobs.api_docs) ------------------------------


def api_docs(request: HttpRequest) -> HttpResponse:
    return render(request, "jobs/api_docs.html", api_docs_page())
