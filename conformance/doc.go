// Package conformance is onceflow's conformance suite: the scenarios that every broker, crossed
// with every database, must pass for onceflow's exactly-once guarantee to hold on it, in the
// spirit of watermill's pubsub/tests. Each scenario runs a real onceflow Router with the real
// broker and database, counts each message's effects in a table without a unique key, and
// checks the deliveries, acks, nacks and dead letters the broker sees.
//
// onceflow runs it for each of its brokers (amqp with classic queues, amqp-quorum with quorum
// queues, postgres, mysql, sqlite, nats, redis, mem) with each database dialect (postgres,
// mysql, sqlite), in each commit mode (per-message, group-commit, batch), in matrix_test.go:
//
//	CI=true go test ./conformance/ -run 'TestConformance/nats/postgres' -v
//	go test ./conformance/ -run 'TestConformance/.*/.*/group-commit/ConnectionCut'
//	go test ./conformance/ -run 'TestConformance_Poison/amqp-quorum' -v
//	ONCEFLOW_CONFORMANCE_POISON=all go test ./conformance/ -run TestConformance_Poison
//
// Test names are TestConformance/<broker>/<database>/<mode>/<scenario>; the Poison scenario
// runs apart, after the others, as TestConformance_Poison/<broker>/<database>/<mode>/Poison,
// on one database per broker unless ONCEFLOW_CONFORMANCE_POISON=all. Run lists the scenarios,
// Features says which apply to a broker. docs/brokers.md says where each applies.
//
// The Poison scenario kills consumer processes: the test binary starts itself as one when its
// TestMain calls ConsumerMain first.
//
// # Your own broker and database
//
// Point the suite at a broker URL and a database URL (a database or schema it may create
// schemas or databases in, or an SQLite file path whose directory it may write):
//
//	ONCEFLOW_CONFORMANCE_BROKER='amqp://guest:guest@rabbit:5672/' \
//	ONCEFLOW_CONFORMANCE_DATABASE='postgres://app@db:5432/app?sslmode=disable' \
//	go test github.com/onceflow/onceflow/conformance -run TestConformance_Environment -v
//
// or call Run from a test of your own, with a Setup that hands each test a fresh database (and
// ConsumerMain in TestMain):
//
//	func TestMain(m *testing.M) {
//		conformance.ConsumerMain()
//		os.Exit(m.Run())
//	}
//
//	func TestOurBrokerConforms(t *testing.T) {
//		conformance.Run(t, conformance.Setup{
//			BrokerURL:   func(testing.TB) string { return os.Getenv("BROKER_URL") },
//			DatabaseURL: func(t testing.TB) string { return newSchema(t) },
//		}, conformance.DefaultFeatures(os.Getenv("BROKER_URL")))
//	}
//
// The suite shortens the broker's delays (Timings); query parameters of the broker URL
// override them. ONCEFLOW_CONFORMANCE_DEBUG=1 sends the watermill adapters' debug logs to the
// test log.
package conformance
