package main

import (
	"context"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

const topic = "payments"

// Payment is the message payload.
type Payment struct {
	Account string `json:"account"`
	Cents   int64  `json:"cents"`
}

// createLedger creates the ledger table, which has no unique key of its own: a payment booked
// twice would be two rows.
func createLedger(ctx context.Context, db *sqldb.DB) error {
	_, err := db.ExecContext(ctx, `CREATE TABLE IF NOT EXISTS ledger (
		payment_id VARCHAR(64) NOT NULL, account VARCHAR(64) NOT NULL, cents BIGINT NOT NULL)`)
	return err
}

// ledgerHandler books each payment of the topic payments into the ledger, exactly once: the
// message id is recorded in the transaction of the INSERT.
func ledgerHandler(sub message.Subscriber, db *sqldb.DB) onceflow.Handler {
	return onceflow.Handler{
		Name:       "ledger",
		Topic:      topic,
		Subscriber: sub,
		DB:         db,
		QoS:        onceflow.ExactlyOnce,
		Processor: processor.JSON(func(ctx context.Context, msg *messagedata.MessageData, p Payment) error {
			tx, _ := processor.TxFromContext(ctx) // opened, committed and rolled back by onceflow
			_, err := tx.ExecContext(ctx, tx.Rebind(`INSERT INTO ledger (payment_id, account, cents) VALUES (?, ?, ?)`), msg.ID, p.Account, p.Cents)
			return err
		}),
	}
}
