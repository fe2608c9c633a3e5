from onegpu.cli import entry

entry()
