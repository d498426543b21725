// Package onceflowtest proves, in an ordinary go test, that a handler of one's own is
// exactly-once: its processor, its stages of its own, its chain edits and its SQL, under the
// faults of production.
//
// Prove runs the handler in competing consumer processes (the test binary, running the calling
// test again) and publishes the messages the test makes: out of order, some twice, with poison
// messages among them. Meanwhile it kills consumers with SIGKILL at random moments and at each
// crash point (after receipt, before the commit, between the commit and the acknowledgement,
// between a dead letter's publish and its record), makes the processor fail or panic once after
// it has written, and cuts the database and broker connections through a loopback proxy. Then
// it counts the effects of each message with the test's own query, and fails the test unless
// every message was applied exactly once (in order, for ExactlyOnceInOrder) and every poison
// message dead-lettered exactly once, saying for each message that went wrong what happened to
// it and what that shows:
//
//	func TestLedgerIsExactlyOnce(t *testing.T) {
//		onceflowtest.Prove(t, onceflowtest.Config{
//			Setup:   createLedger, // CREATE TABLE IF NOT EXISTS ledger ...
//			Handler: func(env onceflowtest.Env) onceflow.Handler { return ledgerHandler(env.Subscriber, env.DB) },
//			Message: func(i int) onceflowtest.Message {
//				return onceflowtest.Message{Payload: []byte(fmt.Sprintf(`{"cents":%d}`, 100+i))}
//			},
//			Effects: `SELECT payment_id, COUNT(*) FROM ledger GROUP BY payment_id`,
//		})
//	}
//
// It runs on the embedded default (an SQLite queue and an SQLite database in the test's
// temporary directory) with no service, and on any broker and database by URL
// (Config.BrokerURL and Config.DBURL, or $ONCEFLOWTEST_BROKER and $ONCEFLOWTEST_DB), so that
// the same test runs in CI against the real stack. docs/testing.md says which crash window
// each fault exercises, and why that is the window production has.
//
// Run is the same engine outside a test (onceflow verify is built on it): its consumer
// processes are a program of one's own that calls Consume.
package onceflowtest
