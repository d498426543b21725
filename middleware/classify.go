package middleware

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"strconv"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// Classifier reports whether running a message again cannot cure err: the error is permanent,
// and the message goes to the dead-letter topic on first sight instead of being retried and
// redelivered. It is DeadLetter's (DeadLetter.Classifier), which Retry asks through
// Delivery.Permanent.
type Classifier func(err error) bool

// DefaultClassifier is the Classifier of DeadLetter unless DeadLetter.Classifier replaces it. These
// errors are permanent:
//
//	processor.Permanent(err)                  the processor said so
//	a malformed payload or header             encoding/json syntax and type errors, strconv and
//	                                          base64 errors
//	messagedata.ErrNoMessageID,               the message's id cannot be recorded
//	dedup.ErrInvalidKey
//	sqldb class Data                          a value too long, a NOT NULL, CHECK or foreign-key
//	                                          violation, a malformed value (SQLSTATE class 22 and 23)
//	sqldb class UniqueViolation               a unique key of the business tables: another message
//	                                          holds it (the dedup key itself never fails this way,
//	                                          and DedupNatural turns the violations it
//	                                          recognises into duplicates before Retry sees them)
//
// Everything else is retryable: serialization failures, deadlocks, lock timeouts, lost
// connections, a commit whose outcome is unknown, a canceled context, and errors this package
// cannot place.
func DefaultClassifier(err error) bool {
	if err == nil {
		return false
	}
	if processor.IsPermanent(err) || errors.Is(err, messagedata.ErrNoMessageID) || errors.Is(err, dedup.ErrInvalidKey) {
		return true
	}
	if errors.Is(err, ErrCommitOutcomeUnknown) || errors.Is(err, ErrGroupAborted) {
		return false // the database's failure or another message's, not this message's
	}
	switch sqldb.Classify(err) {
	case sqldb.Data, sqldb.UniqueViolation:
		return true
	case sqldb.Conflict, sqldb.Connection:
		return false
	}
	var (
		syntax   *json.SyntaxError
		jsonType *json.UnmarshalTypeError
		num      *strconv.NumError
		b64      base64.CorruptInputError
	)
	return errors.As(err, &syntax) || errors.As(err, &jsonType) || errors.As(err, &num) || errors.As(err, &b64)
}
