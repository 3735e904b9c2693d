from understudy.cli.main import main

main()
