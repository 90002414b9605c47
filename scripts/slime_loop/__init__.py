"""slime's own train.py / train_async.py on Turnstile with a CPU trainer: see main.py and scripts/slime_loop.sh."""
