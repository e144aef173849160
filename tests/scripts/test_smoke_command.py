"""`rollout smoke` (the README's fallback check) against the session redis-server."""

from scripts.smoke import main


def test_smoke_pulls_every_pushed_group(redis_url, capsys):
    assert main(["--redis-url", redis_url, "--steps", "3", "--batch", "4", "--n", "2", "--response-len", "32"]) == 0
    out = capsys.readouterr().out
    assert "pushed         12 groups" in out and "= 24 samples" in out and "smoke ok" in out
