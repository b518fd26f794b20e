from mrl.cli import main

main()
