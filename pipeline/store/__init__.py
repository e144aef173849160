"""Redis plumbing: every client and its outage rules (`redis_conn`), the group stream (`buffer`),
the arq job envelope (`jobqueue`), and a private redis-server or fakeredis for tests and the
demo (`local_redis`, `fake_redis`)."""
