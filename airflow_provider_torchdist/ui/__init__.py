"""The ``torchdist`` Airflow plugin: a "Training" tab on every task instance's page.

The tab is an external view (an iframe on the API server's own origin) that draws one chart per
``report()`` metric against the step, the run's progress, ETA and world size, refreshing every two
seconds until the task ends. Its data comes from one authenticated JSON endpoint::

    GET /torchdist/api/runs/{dag_id}/{run_id}/{task_id}?map_index=-1

The modules, by job: :mod:`.plugin` (what Airflow loads: the plugin class, light to import in every
component), :mod:`.app` (the FastAPI app: routes and authorization, built on first request),
:mod:`.task_facts` (what Airflow and the run's lifeline know about one task instance),
:mod:`.figures` (the pure function that turns those facts into the endpoint's answer), and
``static/`` (the page: plain HTML, CSS and JavaScript, no build step, nothing from the internet).
"""
