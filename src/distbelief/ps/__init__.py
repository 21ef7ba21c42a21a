"""The sharded parameter server: plan (pure), update rules (pure), shard actor, client."""
