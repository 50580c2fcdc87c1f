"""The handlers of the `openflash` command, one module per area; library modules stay free of argparse."""
