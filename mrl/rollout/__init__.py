"""The rollout process: async engine client, reply parsing, rollout manager, producer, buffer, multi-turn."""
