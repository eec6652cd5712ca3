from appliance.worker.main import main

main()
