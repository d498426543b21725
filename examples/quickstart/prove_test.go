package main

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/onceflowtest"
)

// The quickstart's handler under faults: consumer processes killed at random and at each crash
// point, failures and panics after the processor wrote, payments published twice and out of
// order, poison messages among them (the built-in ones, and a payload that does not decode). On
// the embedded default; with $ONCEFLOWTEST_BROKER and $ONCEFLOWTEST_DB, and their packages
// imported, on a real broker and database.
func TestLedgerHandler_IsExactlyOnceUnderFaults(t *testing.T) {
	onceflowtest.Prove(t, onceflowtest.Config{
		Setup: createLedger,
		Handler: func(env onceflowtest.Env) onceflow.Handler {
			return ledgerHandler(env.Subscriber, env.DB)
		},
		Message: func(i int) onceflowtest.Message {
			body, _ := json.Marshal(Payment{Account: fmt.Sprintf("acct-%d", i%7), Cents: int64(100 + i)})
			return onceflowtest.Message{Payload: body}
		},
		Effects: `SELECT payment_id, COUNT(*) FROM ledger GROUP BY payment_id`,
		Poison: append(onceflowtest.DefaultPoison,
			onceflowtest.Poison{Name: "malformed", Message: onceflowtest.Message{Payload: []byte(`{"account": "acct-1", "cents": `)}}),
	})
}
