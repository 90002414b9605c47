"""Agent programs as rollouts: a session gateway serving model APIs (gateway.py, openai_chat.py) whose requests
are turns of the engine's trajectories (session.py), matched message by message (history.py)."""
