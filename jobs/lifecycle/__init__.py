"""A run's and a role's life on the platform, from admission to the last exit.

A run's roles: ``trainer-0`` runs the pipeline (trainer, sample queue, weight service, evaluator, and its
own rollout processes on its host: a dead one is restarted by the runtime itself, within
``resources.rollout_restarts``). Its data-parallel trainer ranks (``resources.trainer_devices``) lie on
its host when one holds the trainer's share, else over several hosts — within one switch when one holds
them, else the fewest hosts (jobs.placement.spread) — and ``trainer-1`` .. ``trainer-<H-1>`` run the
ranks on the further hosts, meeting ``trainer-0`` at its host's rendezvous. A spec with
``resources.remote_rollout_workers: N`` adds the roles ``rollout-0`` .. ``rollout-<N-1>``: rollout
instances that run as processes of their own, one device each, on any host, and connect to the trainer;
``resources.remote_evaluator: true`` adds ``evaluator``, the evaluator as such a process.

    names        what a role's name says about it (pure)
    roles        which roles an admission launches, where they go, which attempts are current
    files        the run directory, an attempt's files, what a role's log says at its end
    dispatch     sending the lifecycle's Celery tasks after the deciding transaction commits
    events       the events the platform records for a run, and the roles' live entries
    role_states  every change of a RunRole row, each a conditional UPDATE
    decide       what a role's end means: a pure function returning a Decision
    apply        records a role's end, gathers the facts, decides and applies the decision
    watchdog     the role watchdog (celery beat): lost hosts, lost start tasks, missed launches

Launching itself (placing an admitted run's roles and sending their start tasks) is jobs.launch; the
host side (starting and watching the processes) is jobs.supervisor. This package's ``__init__`` imports
nothing, so importing one module of it loads no other.
"""
