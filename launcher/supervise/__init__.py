"""Running a deployment: the supervisor loop and its slots, tensor-parallel rank groups, the admin
API client, start-up progress and port checks. How a worker is restarted lives here."""
