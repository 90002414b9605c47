from scripts.slime_train_path.main import entry

entry()
